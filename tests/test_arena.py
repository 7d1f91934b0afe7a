"""The combine-input arena's segment allocator (csrc/arena.cpp) and its sizing (transport/arena.py).

torch calls ``ep_arena_alloc`` / ``ep_arena_free`` by name through ctypes; so do these tests, on the
compiled library itself. Parts are registered at made-up addresses: handing a part out and taking it
back never touches device memory, so this runs without a GPU. A request no part can serve goes to
cudaMalloc, which fails without a GPU (null, as torch expects on an out-of-memory error). The pool
that torch builds on top, and the combine that reads from it, are tested on the GPU
(test_hybrid_in_place.py, test_megatron_arena.py).
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from ep_plugin import _cuda
from ep_plugin.integrations.megatron.arena import DEFAULT_ARENA_SHARE, default_combine_input_rows, takes_output
from ep_plugin.transport.arena import (
    ARENA_OVERHEAD_BYTES,
    LARGE_PART_MIN_BYTES,
    SEGMENT_ROUND_BYTES,
    SMALL_PART_BYTES,
    arena_bytes,
)

MiB = 1 << 20


def test_arena_bytes_fit_the_caching_allocators_segments():
    assert arena_bytes(0) == 0
    # A small input still gets the large part torch asks for exactly (>= 10 MiB).
    assert arena_bytes(1) == SMALL_PART_BYTES + LARGE_PART_MIN_BYTES
    # Larger ones round up to torch's 2 MiB segment granularity.
    assert arena_bytes(10 * MiB + 1) == SMALL_PART_BYTES + 12 * MiB
    assert arena_bytes(7168 * 2 * 32768) == SMALL_PART_BYTES + 7168 * 2 * 32768  # already a 2 MiB multiple
    for size in (1, 3 * MiB, 10 * MiB, 123456789):
        total = arena_bytes(size)
        assert total - SMALL_PART_BYTES >= size and (total - SMALL_PART_BYTES) % SEGMENT_ROUND_BYTES == 0
        assert total <= max(size, 1) + ARENA_OVERHEAD_BYTES


# Megatron's default: the standard shape's hidden size and routing, 8 ranks, one H200's memory.
STANDARD = dict(num_ranks=8, ranks_on_one_gpu=8, max_tokens_per_rank=4096, num_local_experts=32,
                experts_per_token=8, pad_multiple=1, hidden_size=7168, gpu_memory_bytes=141 << 30)


def test_megatron_arena_by_default_only_when_every_rank_is_on_one_gpu():
    rows = default_combine_input_rows(**STANDARD)
    assert rows == 2 * 4096 * 8  # twice the balanced share: every rank's tokens spread evenly, top-8
    # One rank per GPU, or some ranks on another GPU: the two-stage combine (in place unmeasured there).
    assert default_combine_input_rows(**{**STANDARD, "ranks_on_one_gpu": 1}) == 0
    assert default_combine_input_rows(**{**STANDARD, "ranks_on_one_gpu": 4}) == 0
    # Padding: each local expert's segment may grow by pad_multiple - 1 rows.
    assert default_combine_input_rows(**{**STANDARD, "pad_multiple": 16}) == 2 * (4096 * 8 + 32 * 15)


def test_megatron_arena_never_exceeds_the_worst_case_or_its_memory_share():
    # Two ranks with top-8 of 8 local experts each: the worst case (every token of both ranks on 8 of
    # this rank's experts) is below twice the balanced share.
    two = {**STANDARD, "num_ranks": 2, "ranks_on_one_gpu": 2, "num_local_experts": 8, "max_tokens_per_rank": 100}
    assert default_combine_input_rows(**two) == 2 * 100 * 8
    # Memory: all the ranks' arenas within the share of the GPU; the rows shrink to what fits ...
    memory = 40 << 30
    rows = default_combine_input_rows(**{**STANDARD, "gpu_memory_bytes": memory})
    assert 4096 * 8 <= rows < 2 * 4096 * 8
    assert 8 * arena_bytes(rows * 2 * 7168) <= DEFAULT_ARENA_SHARE * memory
    # ... and none at all when not even the balanced share fits (most combines would miss it).
    assert default_combine_input_rows(**{**STANDARD, "gpu_memory_bytes": 8 << 30}) == 0


def test_megatron_default_arena_leaves_decode_sized_outputs_to_the_two_stage_combine():
    # Measured on one H200 (hidden 7168): the pool's host cost outweighs the gain at 1024 rows per rank
    # (128 tokens, top-8, 8 ranks) and the arena wins from 4096 rows (512 tokens) on.
    assert not takes_output(1024, 7168, default_arena=True)
    assert takes_output(4096, 7168, default_arena=True)
    # An arena the user asked for (EP_PLUGIN_COMBINE_INPUT_ROWS) takes every output that fits.
    assert takes_output(1024, 7168, default_arena=False) and takes_output(1, 8, default_arena=False)


@pytest.fixture()
def library(extension):
    lib = ctypes.CDLL(extension.__file__)
    lib.ep_arena_alloc.restype = ctypes.c_void_p
    lib.ep_arena_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.ep_arena_free.restype = None
    lib.ep_arena_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return _cuda._module, lib


def test_segments_come_from_the_selected_arena_smallest_part_first(library):
    _check_segments_come_from_the_selected_arena(*library)


@pytest.mark.gpu
def test_segments_past_the_arena_come_from_cuda_malloc_on_a_gpu(library):
    """The same on a GPU, where what the arena cannot serve is cudaMalloc'd (and freed) rather than null."""
    C, lib = library
    assert C.cuda_device_count() > 0
    _check_segments_come_from_the_selected_arena(C, lib)


def _check_segments_come_from_the_selected_arena(C, lib):
    small, large = 0x7000_0000_0000, 0x7000_0020_0000  # never dereferenced
    C.arena_register(9001, 0, [(large, 16 * MiB), (small, 2 * MiB)])
    try:
        assert C.arena_select(9001) == 0
        assert lib.ep_arena_alloc(2 * MiB, 0, None) == small  # both fit: the smaller part
        assert lib.ep_arena_alloc(2 * MiB, 0, None) == large  # the small one is lent now
        assert C.arena_lent_parts(9001) == 2
        beyond = lib.ep_arena_alloc(2 * MiB, 0, None)  # nothing left: cudaMalloc (null without a GPU, no exception)
        assert beyond not in (small, large) and (beyond is None) == (C.cuda_device_count() == 0), beyond
        if beyond is not None:
            lib.ep_arena_free(beyond, 2 * MiB, 0, None)  # not the arena's: cudaFree'd
        lib.ep_arena_free(small, 2 * MiB, 0, None)  # given back: lent no more, never cudaFree'd
        assert C.arena_lent_parts(9001) == 1
        assert lib.ep_arena_alloc(1 * MiB, 0, None) == small
        lib.ep_arena_free(small, 2 * MiB, 0, None)
        lib.ep_arena_free(large, 16 * MiB, 0, None)
        assert C.arena_lent_parts(9001) == 0
        # Too big for any part, another device, or no arena selected: not from the arena.
        for size, device, selected in ((17 * MiB, 0, 9001), (1 * MiB, 1, 9001), (1 * MiB, 0, 0)):
            C.arena_select(selected)
            got = lib.ep_arena_alloc(size, device, None)
            assert got not in (small, large), (size, device, selected)
            if C.cuda_device_count() == 0:
                assert got is None, (size, device, selected)
            elif got is not None:  # cudaMalloc's (None on a device this machine lacks)
                lib.ep_arena_free(got, size, device, None)
        assert C.arena_lent_parts(9001) == 0
    finally:
        C.arena_select(0)
        C.arena_unregister(9001)


def test_selection_is_per_thread_and_nests(library):
    C, lib = library
    C.arena_register(9002, 0, [(0x7100_0000_0000, 2 * MiB)])
    C.arena_register(9003, 0, [(0x7200_0000_0000, 2 * MiB)])
    try:
        outer = C.arena_select(9002)
        assert C.arena_select(9003) == 9002  # an inner selection returns the outer one to restore
        seen = []
        worker = threading.Thread(target=lambda: seen.append(C.arena_select(0)))
        worker.start()
        worker.join()
        assert seen == [0], "another thread saw this thread's selection"
        assert lib.ep_arena_alloc(4096, 0, None) == 0x7200_0000_0000
        assert C.arena_select(9002) == 9003
        assert lib.ep_arena_alloc(4096, 0, None) == 0x7100_0000_0000
        C.arena_select(outer)
        # An unregistered arena's part given back by a pool later is dropped (never cudaFree'd).
        C.arena_unregister(9003)
        lib.ep_arena_free(0x7200_0000_0000, 2 * MiB, 0, None)
        assert C.arena_lent_parts(9003) == 0 and C.arena_lent_parts(9002) == 1
        lib.ep_arena_free(0x7100_0000_0000, 2 * MiB, 0, None)
    finally:
        C.arena_select(0)
        C.arena_unregister(9002)
        C.arena_unregister(9003)


def test_arena_refuses_a_size_smaller_than_its_parts():
    from ep_plugin.transport.arena import CombineInputArena

    with pytest.raises(ValueError, match="arena_bytes"):
        CombineInputArena(None, torch.device("cuda", 0), 0, SMALL_PART_BYTES)
