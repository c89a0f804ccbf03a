"""Host memory reuse for CPU runs: large XLA buffers without a page fault per 4 KiB on every call.

On Linux with glibc, XLA's CPU runtime allocates each execution's large buffers (a full-softmax chunk's
[rows × items] logits, probabilities and their gradients: hundreds of MB) with malloc, which serves
blocks above 32 MiB, and any block of a worker thread's arena above 64 MiB, with a fresh mmap and returns
them with munmap. Every call then touches new pages: the kernel faults and zeroes each 4 KiB page again.
Measured on a 2-core host, Amazon Games DPFormer, one non-private step of 1,024 users: 590,000 minor
faults (2.3 GB of pages zeroed) and 1.9-2.2 s; with the settings below 0 faults and 1.1-1.3 s. A single
[1024 × 64]·[64 × 23,716] matmul: 50 ms, half of it faulting in its 97 MB output.

`reuse_freed_memory()` sets glibc's malloc to one arena that never maps large blocks separately and keeps
up to 2 GiB of freed memory for reuse (mallopt M_ARENA_MAX = 1, M_MMAP_MAX = 0, M_TRIM_THRESHOLD =
2³¹ − 1), the same as starting Python with MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=2147483647. It acts on threads created afterwards: call it before the first JAX
computation (JAX starts its CPU worker threads then); `jdp` commands call it when `JDP_HOST_MALLOC=reuse`.

Opt-in, because it is not free. Measured on the same host (`benchmarks/seqrec/speed.py`, one Amazon Games
epoch): non-private 38.2 s instead of 62.7 s; DP-SGD 54.1 s in one pass per physical chunk (73.1 s without),
while the clipping engine's default chunks of a few users run slower with it (71.5 s vs 52.9 s), so DP gains
nothing at its best setting. XLA compilation, whose threads then share one arena, took 25-35% longer (the
DP step of `jdp seqrec --data synthetic`: 6.1-7.1 s vs 4.6-5.3 s), which costs short runs more than it saves. And memory the process
frees stays with it. Worth it for long runs dominated by large buffers (non-private full-softmax training
over a big catalogue). Elsewhere (macOS, musl, a preloaded tcmalloc/jemalloc, which already reuse memory)
it does nothing; `JDP_HOST_MALLOC=system` turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_KEEP_BYTES = 2**31 - 1  # the largest value mallopt takes (an int)
_state: dict = {}


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only (musl has no mallopt settings of these)
        return libc
    except (OSError, AttributeError):
        return None


def reuse_freed_memory() -> bool:
    """Sets glibc malloc to reuse freed large blocks (see the module doc). Returns True when the settings are
    in effect (also on a repeated call), False where they do not apply or `JDP_HOST_MALLOC=system`."""
    if "enabled" in _state:
        return _state["enabled"]
    libc = None if os.environ.get("JDP_HOST_MALLOC", "").lower() == "system" else _glibc()
    ok = libc is not None and all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_BYTES)))
    _state["enabled"] = bool(ok)
    return _state["enabled"]


def reuse_freed_memory_if_requested() -> bool:
    """`reuse_freed_memory()` when the environment asks for it (`JDP_HOST_MALLOC=reuse`), else nothing: how
    `jdp` commands and the benchmarks opt in."""
    return os.environ.get("JDP_HOST_MALLOC", "").lower() == "reuse" and reuse_freed_memory()


__all__ = ["reuse_freed_memory", "reuse_freed_memory_if_requested"]
