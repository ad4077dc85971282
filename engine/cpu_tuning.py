"""Process-wide settings that make CPU inference faster; applied by the processes pdcluster owns
(serving nodes, the CLI, benchmarks), never implicitly by the `engine` library.

glibc serves allocations above its mmap threshold (128 KiB by default, adapting upwards) with
fresh mmap'd pages and returns them on free, so every forward's large activations are
page-faulted and zeroed by the kernel again: on a small CPU host that doubles the time of the
elementwise ops. Raising the threshold keeps them in the heap for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit hosts.
_THRESHOLD = 32 * 1024 * 1024


def keep_large_allocations_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds; False where there is no glibc to tune."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; allocator left as it was")
    return ok


def freeze_startup_heap() -> None:
    """Move every object alive now (the libraries, the model's config, the tokenizer: millions
    of objects once torch and transformers are imported) out of the garbage collector's sight.
    A serving process allocates small objects per token; each of the collector's full passes
    then walks the whole heap, which cost about a fifth of a front end's time under load."""
    gc.collect()
    gc.freeze()
