"""Argument checks shared by every module: one place decides what an integer argument is.

A bool is an int to Python (`True + 1 == 2`), but never a meaningful count, size or version, so
it is refused everywhere. Floats are refused too, even integral ones (4.0): silently truncating a
batch size or a version hides a caller's bug.
"""

from __future__ import annotations

from typing import Any

_SHOWN_CHARS = 80  # a refused value is quoted up to this many characters (a tensor's repr is long)


def is_int(value: Any) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, name: str, *, low: int | None = None, high: int | None = None,
              allow_none: bool = False, error: type[Exception] | None = None) -> int | None:
    """`value` when it is an int (not a bool) in [low, high] (bounds inclusive, each optional), or
    None when `allow_none`. Otherwise TypeError (not an int) or ValueError (out of range), with a
    message naming `name`, the accepted values and the value received. `error` raises that type
    for both instead: a field of a loaded document, where any problem is a malformed value."""
    if value is None and allow_none:
        return None
    if not is_int(value):
        raise (error or TypeError)(f"{name} must be {_accepted(low, high, allow_none)}, got "
                                   f"{_shown(value)} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        raise (error or ValueError)(f"{name} must be {_accepted(low, high, allow_none)}, got {value}")
    return value


def _accepted(low: int | None, high: int | None, allow_none: bool) -> str:
    if low is not None and high is not None:
        what = f"an int in [{_bound(low)}, {_bound(high)}]"
    elif low is not None:
        what = f"an int >= {_bound(low)}"
    elif high is not None:
        what = f"an int <= {_bound(high)}"
    else:
        what = "an int"
    return f"None or {what}" if allow_none else what


def _bound(limit: int) -> str:
    """A large power-of-two limit as 2**k, -2**k or 2**k - 1 (an int64 or 62-bit version bound),
    which a reader recognizes."""
    k = abs(limit).bit_length() - 1
    if k >= 16 and abs(limit) == 1 << k:
        return f"-2**{k}" if limit < 0 else f"2**{k}"
    if limit >= 1 << 16 and limit + 1 == 1 << (k + 1):
        return f"2**{k + 1} - 1"
    return str(limit)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
