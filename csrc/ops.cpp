// Op schemas for the torchreplay namespace, declared once. Back ends register implementations per
// dispatch key in cpu/*.cpp and cuda/tree_cuda_ops.cpp.
#include <Python.h>
#include <torch/library.h>
#include <torch/version.h>

#include "shard_reader.h"

#ifdef TORCHREPLAY_WITH_CUDA
#include "cuda/tree_cuda.h"
#endif

// What this binary was compiled against, so torchreplay/_ops.py can refuse a different torch with a
// clear message instead of a crash. It lives in the .so (not in a Python file written beside it) so
// that a stale binary can never disagree with it. setup.py passes torch.__version__ and
// torch.version.cuda; without them (the compile-only CUDA check) the headers' version stands in.
#ifndef TORCHREPLAY_BUILT_TORCH_VERSION
#define TORCHREPLAY_BUILT_TORCH_VERSION TORCH_VERSION
#endif
#ifndef TORCHREPLAY_BUILT_TORCH_CUDA
#define TORCHREPLAY_BUILT_TORCH_CUDA "unknown"
#endif
// The ABI the compiler actually used for this file (torch's build flags set it), rather than what
// setup.py believed: libc++ has no such macro, hence "unknown".
#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
#define TORCHREPLAY_BUILT_CXX11_ABI "1"
#elif defined(_GLIBCXX_USE_CXX11_ABI)
#define TORCHREPLAY_BUILT_CXX11_ABI "0"
#else
#define TORCHREPLAY_BUILT_CXX11_ABI "unknown"
#endif

// One literal with a fixed prefix: _ops.py also finds it by reading the file's bytes when the
// module cannot be loaded at all (undefined symbols under another torch), to name the torch it needs.
static const char kBuildInfo[] = "torchreplay-build-info:torch=" TORCHREPLAY_BUILT_TORCH_VERSION
                                 ";cxx11_abi=" TORCHREPLAY_BUILT_CXX11_ABI ";cuda=" TORCHREPLAY_BUILT_TORCH_CUDA ";";

// Importing torchreplay._C runs the registrations below; the module itself exposes only BUILD_INFO.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddStringConstant(module, "BUILD_INFO", kBuildInfo) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

namespace torchreplay {

// -1 when built without CUDA; otherwise CUDART_VERSION (e.g. 12080), compared with torch's at import.
int64_t cuda_version() {
#ifdef TORCHREPLAY_WITH_CUDA
  return tree::cuda::runtime_version();
#else
  return -1;
#endif
}

// The shard reader's row layouts and codes by name (csrc/shard_reader.h), for the import-time check.
std::string shard_reader_layout() { return shard::layout_description(); }

TORCH_LIBRARY(torchreplay, m) {
  m.def("tree_update(Tensor(a!) leaves, Tensor(b!) sums, Tensor(c!) mins, Tensor indices, Tensor priorities, "
        "int capacity) -> ()");
  m.def("tree_sample(Tensor leaves, Tensor sums, Tensor u, int capacity, bool stratified) -> (Tensor, Tensor)");
  // sample(batch_size) on the CPU, uniforms counter_uniform(seed, k) drawn inside (CPU only: on a
  // GPU, torch.rand on the device is already cheap and needs no host-side seed).
  m.def("tree_sample_seeded(Tensor leaves, Tensor sums, int seed, int batch_size, int capacity, bool stratified) "
        "-> (Tensor, Tensor)");
  m.def("tree_total(Tensor sums) -> Tensor");
  m.def("tree_min(Tensor mins) -> Tensor");
  m.def("tree_get(Tensor leaves, Tensor indices, int capacity) -> Tensor");
  m.def("tree_rebuild(Tensor(a!) leaves, Tensor(b!) sums, Tensor(c!) mins, int capacity) -> ()");
  m.def("pad_rows(Tensor[] values, Tensor source, Tensor starts, Tensor lengths, Tensor dest, Tensor(a!) out, "
        "bool left, Scalar? fill=None) -> ()");
  // Packed (varlen) batches: row k of values[source[k]] to out[offsets[k] : offsets[k] + lengths[k]].
  m.def("pack_rows(Tensor[] values, Tensor source, Tensor starts, Tensor lengths, Tensor offsets, Tensor(a!) out) "
        "-> ()");
  // Cold-tier reads (csrc/shard_reader.h): pread + page CRC32 + row copies for many shards at once.
  m.def("read_shard_rows(str[] paths, Tensor segments, Tensor rows, Tensor crcs, Tensor(a!)[] dests, "
        "Tensor(b!) page_state, bool direct, int threads) -> Tensor");
  m.def("shard_reader_layout() -> str", &shard_reader_layout);
  m.def("page_crc32(Tensor data, int page_size) -> Tensor");
  m.def("span_crc32(Tensor data, Tensor spans) -> Tensor");
  m.def("cuda_version() -> int", &cuda_version);
}

}  // namespace torchreplay
