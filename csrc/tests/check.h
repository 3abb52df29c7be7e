// The C++ tests' one assertion: report and count a failed condition, keep going, and let main()
// turn the count into the exit status, so one run shows every failure.
#pragma once

#include <cstdio>

namespace torchreplay {
namespace testing {
inline int failures = 0;
}  // namespace testing
}  // namespace torchreplay

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
      ++::torchreplay::testing::failures;                         \
    }                                                             \
  } while (0)
