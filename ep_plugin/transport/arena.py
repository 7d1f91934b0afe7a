"""The combine-input arena: a torch memory pool over a region of this rank's symmetric buffer.

An in-place combine reads the expert output rows where they lie, in the expert rank's buffer,
instead of having that rank sum and push them first. That needs the expert output to *be* in the
buffer. The arena makes that possible for code that allocates its own output (Megatron's experts,
any torch op): inside ``allocating()`` this thread's torch allocations come from a
``torch.cuda.MemPool`` whose segments are the arena's memory, so a tensor computed there is
readable by the peers with no copy.

How: torch's caching allocator asks a pool's allocator for whole segments and splits them into
blocks itself. The pool's allocator is the extension's ``ep_arena_alloc``/``ep_arena_free``
(csrc/arena.cpp), which serve a segment request from a free part of the arena selected on the
calling thread and otherwise from plain ``cudaMalloc``. The arena is two parts, because the
caching allocator keeps two kinds of segments: a 2 MiB part for its small blocks (requests up to
1 MiB) and a large part, at least 10 MiB (requests of 10 MiB or more are asked for exactly, rounded
to 2 MiB). Right after the pool is made, one allocation of each kind takes the two parts as the
pool's segments and is freed again: the pool keeps both and splits them for later allocations.
When torch does not take them (a torch without ``MemPool``, or allocator settings that round the
request differently) the arena is unusable, says why (``unusable_reason``) and nothing is routed.

The arena knows no backend; the hybrid backend decides when allocating there is safe (peers read
an input until the next op) and where a combine input lies (``offset_of``).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from .. import streams

SMALL_PART_BYTES = 2 << 20  # torch's segment for blocks of <= 1 MiB (kSmallBuffer)
LARGE_PART_MIN_BYTES = 10 << 20  # torch asks for segments of >= 10 MiB exactly (kMinLargeAlloc) ...
SEGMENT_ROUND_BYTES = 2 << 20  # ... rounded up to 2 MiB (kRoundLarge)
# What arena_bytes adds at most to a combine input's bytes: the small part, plus the large part's
# rounding up (to 2 MiB, or to its 10 MiB minimum).
ARENA_OVERHEAD_BYTES = SMALL_PART_BYTES + LARGE_PART_MIN_BYTES
_SMALL_REQUEST_BYTES = 512  # an allocation that torch serves from a small segment

_arena_ids = itertools.count(1)


def arena_bytes(input_bytes: int) -> int:
    """Bytes of an arena in which a combine input of ``input_bytes`` fits (0: no arena)."""
    if input_bytes <= 0:
        return 0
    large = -(-input_bytes // SEGMENT_ROUND_BYTES) * SEGMENT_ROUND_BYTES
    return SMALL_PART_BYTES + max(large, LARGE_PART_MIN_BYTES)


class CombineInputArena:
    """The arena at ``address`` (``nbytes`` from ``arena_bytes``) on ``device``; its pool is made on
    first use.

    Args:
        extension: ``ep_plugin._C`` (the allocator functions live in its library).
        device: the buffer's CUDA device.
        address: device address of the arena (in this rank's symmetric buffer).
        nbytes: its size; the memory stays the buffer's (``destroy`` only forgets it).
    """

    def __init__(self, extension, device: torch.device, address: int, nbytes: int) -> None:
        if nbytes < SMALL_PART_BYTES + LARGE_PART_MIN_BYTES:
            raise ValueError(f"a combine-input arena needs >= {SMALL_PART_BYTES + LARGE_PART_MIN_BYTES} bytes, "
                             f"got {nbytes} (size it with arena_bytes)")
        self._C = extension
        self.device = device
        self.address = address
        self.nbytes = nbytes
        self.id = next(_arena_ids)
        self._large_bytes = nbytes - SMALL_PART_BYTES
        self._C.arena_register(self.id, device.index, [(address, SMALL_PART_BYTES),
                                                        (address + SMALL_PART_BYTES, self._large_bytes)])
        self._pool = None
        self._pool_stream = 0  # the stream the pool's segments belong to
        self.pools_made = 0  # pools made over the arena so far (1 in a steady loop; more: see pool())
        self.snapshots_taken = 0  # pool snapshots (each costs host time; 0 in a steady loop on one stream)
        self.unusable_reason: Optional[str] = None  # set when the pool could not take the arena

    def pool(self):
        """The arena's ``torch.cuda.MemPool`` for allocations on the current stream, made on first call;
        None when the arena is unusable.

        torch hands out a segment's blocks only to allocations on the stream it was made on, the
        current one when the pool took the arena; and after the arena once ran full the pool also
        holds the ordinary memory it got then, where torch's best fit would go on placing outputs.
        In both cases, once nothing is allocated in the pool it is dropped (torch gives both kinds of
        segments back) and a new one takes the arena on the current stream. Until then allocations
        that miss the arena get ordinary memory (and their combine is two-stage)."""
        stream = streams.stream_handle(self.device)  # every call: 0.2 µs where current_stream() costs 3-5
        if self._pool is not None:
            stale = stream != self._pool_stream or self._C.arena_fallback_segments(self.id)
            if stale:
                self.snapshots_taken += 1
                if self._is_empty(self._pool):
                    self._pool = None
        if self._pool is None and self.unusable_reason is None:
            self._pool = self._make_pool()
            self._pool_stream = stream
            if self._pool is not None:
                self.pools_made += 1
        return self._pool

    @contextmanager
    def allocating(self) -> Iterator[bool]:
        """Inside, this thread's CUDA allocations on the arena's device come from the arena (while it
        has room; then from ordinary memory). Yields whether the arena is usable at all."""
        pool = self.pool()
        if pool is None:
            yield False
            return
        with self._routed(pool):
            yield True

    def offset_of(self, tensor: torch.Tensor) -> Optional[int]:
        """Byte offset of a contiguous tensor's data in the arena, or None when any of it lies
        outside (or the offset is not a multiple of 16, which the kernels' loads need)."""
        if tensor.numel() == 0 or tensor.device != self.device or not tensor.is_contiguous():
            return None
        offset = tensor.data_ptr() - self.address
        end = offset + tensor.numel() * tensor.element_size()
        if offset < 0 or end > self.nbytes or offset % 16:
            return None
        return offset

    def lent_parts(self) -> int:
        """Parts of the arena its pool holds as segments (2 once the pool is made)."""
        return self._C.arena_lent_parts(self.id)

    def fallback_segments(self) -> int:
        """Segments of ordinary memory the pool took while the arena was full (0 normally)."""
        return self._C.arena_fallback_segments(self.id)

    def destroy(self) -> bool:
        """Drop the pool and forget the arena, before its buffer is freed (a later buffer may get the
        same addresses); tensors still in it must not be used. Returns whether the pool still holds part of
        the arena (a tensor in it is alive): then the buffer must not be freed, or a later buffer at the
        same address would be lent to a new pool while the old one still holds it (two pools handing out the
        same bytes; torch gives the old segment back whenever it likes)."""
        self._pool = None  # torch gives the pool's free segments back now, while the arena is known
        still_held = self._C.arena_lent_parts(self.id) > 0
        self._C.arena_unregister(self.id)
        self.unusable_reason = "the arena was destroyed with its buffer"
        return still_held

    # ---- the pool ------------------------------------------------------------------------------

    @contextmanager
    def _routed(self, pool) -> Iterator[None]:
        previous = self._C.arena_select(self.id)
        try:
            with torch.cuda.use_mem_pool(pool, self.device):
                yield
        finally:
            self._C.arena_select(previous)

    @staticmethod
    def _is_empty(pool) -> bool:
        """Whether no block of ``pool`` is allocated or waiting on another stream (torch's snapshot of
        the pool; a torch that cannot take one says no, and the pool stays)."""
        try:
            segments = torch.cuda.memory_snapshot(pool.id)
        except (TypeError, RuntimeError):
            return False
        return all(block["state"] == "inactive" for segment in segments for block in segment["blocks"])

    def _make_pool(self):
        if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
            self.unusable_reason = f"torch {torch.__version__} has no torch.cuda.MemPool / use_mem_pool"
            return None
        allocator = torch.cuda.memory.CUDAPluggableAllocator(self._C.__file__, self._C.ARENA_ALLOC_SYMBOL,
                                                             self._C.ARENA_FREE_SYMBOL)
        raw = allocator.allocator() if hasattr(allocator, "allocator") else allocator._allocator
        with torch.cuda.device(self.device):  # a pool belongs to the device current at its making
            pool = torch.cuda.MemPool(raw)
        with self._routed(pool):
            small = torch.empty(_SMALL_REQUEST_BYTES, dtype=torch.uint8, device=self.device)
            large = torch.empty(self._large_bytes, dtype=torch.uint8, device=self.device)
            placed = (small.data_ptr() == self.address and large.data_ptr() == self.address + SMALL_PART_BYTES)
            del small, large  # the blocks go back to the pool, which keeps both segments
        if not placed:
            self.unusable_reason = ("torch's caching allocator did not take the arena as its pool's segments "
                                    "(allocator settings that round segment sizes differently?)")
            return None
        return pool
