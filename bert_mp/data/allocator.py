"""glibc malloc settings for prepare's tokenizing processes.

Encoding a block allocates and frees buffers of megabytes (the Rust tokenizer's per-document
vectors, the token id lists). Under glibc's defaults a freed buffer above the mmap threshold goes
back to the kernel and the next one is faulted in afresh, page by page; on a 2-vCPU VM that
was 1.0-1.6 s of system time on a 13 MB corpus of long documents (about 400k minor faults),
against 0.3-0.4 s (about 100k) with the settings below (``docs/data-corpora.md``).

:func:`tuned` keeps freed memory in the process for reuse: large buffers come from the heap,
and the heap's top is not handed back while prepare runs. Only where the C library is glibc,
and not where the user has set malloc options of their own (``GLIBC_TUNABLES`` or a
``MALLOC_*_`` variable): those are left as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""``mallopt`` parameters (glibc's malloc.h)."""

MMAP_THRESHOLD = 32 << 20
"""Allocations below this come from the heap (32 MiB: glibc's largest on 64-bit)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top kept up to this much."""
TOP_PAD = 64 << 20
"""Extra heap asked of the kernel at each growth (used pages only count as resident)."""

TUNED = {M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: TRIM_THRESHOLD, M_TOP_PAD: TOP_PAD}
"""Set by :func:`tuned` while prepare builds."""

SETTLED = {M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: 2 * MMAP_THRESHOLD, M_TOP_PAD: 128 << 10}
"""Left in place after :func:`tuned`: the thresholds glibc's own dynamic rule reaches once a
buffer of ``MMAP_THRESHOLD`` has been freed (trim = twice the mmap threshold), the default pad."""

_USER_VARS = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(os.environ.get(v) for v in _USER_VARS):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist
    except (OSError, AttributeError):
        return None
    return libc


def available() -> bool:
    """Whether :func:`tuned` changes anything here (glibc, no malloc options of the user's)."""
    return _libc() is not None


def _set(libc: ctypes.CDLL, settings: dict[int, int]) -> bool:
    """``mallopt`` each setting; whether glibc took every one."""
    return all(libc.mallopt(param, value) == 1 for param, value in settings.items())


@contextlib.contextmanager
def tuned() -> Iterator[bool]:
    """:data:`TUNED` while the block runs (worker processes forked inside inherit it); then
    :data:`SETTLED` and the free heap handed back (``malloc_trim``). Yields whether it applied."""
    libc = _libc()
    applied = libc is not None and _set(libc, TUNED)
    try:
        yield applied
    finally:
        if applied:
            _set(libc, SETTLED)
            libc.malloc_trim(0)


def release_free_memory() -> None:
    """Hand the heap's free memory back to the kernel now (``malloc_trim``; glibc only, whatever the
    malloc options). After a large transient job such as learning a vocabulary (~450 MB for a
    50 M-character sample, freed when it ends but kept by :func:`tuned`'s trim threshold): worker
    processes forked afterwards would otherwise start with those pages mapped."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
