"""The host allocator's settings for a process that runs forward passes.

A step allocates and frees the same tensors every time (activations, attention's gathered
context, logits): tens of MB a step, in pieces of up to a few MB. glibc's malloc hands pieces over
its mmap threshold straight back to the kernel when freed, and returns the top of its heap once
more than its trim threshold is free (thresholds that it grows itself only up to 32 MB and 64 MB).
Each step then faults fresh zeroed pages in again: a 64 x 128 decode of SmolLM2 took 11.8 million
minor page faults (about 45 GB of zeroed pages). `retain_freed_memory` makes malloc keep what it
was given instead, as jemalloc and tcmalloc do (Intel's advice for PyTorch on CPUs): the
process's resident memory settles at its largest step's within a step or two.

It settles a little higher on glibc that keeps `posix_memalign`'s small remainders in its
per-thread cache (fixed upstream with bug 30723; Debian 12's 2.36 keeps them): they stay in use
as far as merging goes, so a hole a freed piece leaves is exactly its size, too small for the same
request, which asks for its alignment on top. Such a piece is faulted in afresh once, elsewhere.

Invariant: only glibc is touched; elsewhere (musl, macOS) this does nothing."""

from __future__ import annotations

import functools
import logging

from kvbaton.runtime.heap import glibc

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit: larger pieces are still mmapped
TRIM_THRESHOLD = 2**30  # free heap kept at its top before any is returned


@functools.cache
def retain_freed_memory() -> bool:
    """Set glibc's thresholds once per process; whether they are set."""
    libc = glibc()
    if libc is None:
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not done:
        log.warning("glibc refused the malloc thresholds: steps will fault their memory in")
    return done
