"""The layout kernel (``csrc/layout.cu``) against the torch layout it replaced, bitwise, in one process.

``HybridBackend._layout`` (the kernel) and ``_layout_torch`` (the oracle) run as plain functions on a
stand-in object with the few attributes they read, so no process group or peer is needed. A second
helper calls the extension directly with sentinel-filled, canary-guarded and optionally misaligned
outputs: every element must be written, nothing past the end, by the vector and the scalar paths.
All tests need a GPU and the compiled extension; without them they skip (fail under --require-gpu).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from ep_plugin import _cuda
from ep_plugin.backends.compiled import CompiledBackend
from ep_plugin.backends.hybrid import HybridBackend
from ep_plugin.routing import ROUTING_MAP, TOPK, Routing

pytestmark = pytest.mark.gpu

OUTPUTS = ("send_slot", "k_index", "expert_counts", "rank_counts", "dense_probs", "input_flags")
RANKS_AND_LOCAL = list(itertools.product((1, 2, 8, 32), (1, 3, 32))) + [(1, 256), (2, 256)]
TOKENS = (0, 1, 7, 4096, 8193)
SENTINEL = -7
CANARY = 67  # elements past each output that must stay untouched


class StandIn(SimpleNamespace):
    """A backend's attributes without a process group or buffers, and the one method ``_layout`` calls
    on ``self`` (bound here like on a backend)."""

    _layout_args = CompiledBackend._layout_args


def stand_in(num_ranks: int, num_local_experts: int, blocking: bool = True) -> StandIn:
    """The attributes ``_layout`` / ``_layout_torch`` use, without a process group or buffers."""
    device = torch.device("cuda", torch.cuda.current_device())
    return StandIn(num_ranks=num_ranks, num_local_experts=num_local_experts,
                   num_experts=num_ranks * num_local_experts, device=device,
                   config=SimpleNamespace(blocking=blocking), _C=_cuda.extension(), num_blocks=16,
                   _stream=lambda: torch.cuda.current_stream(device).cuda_stream,
                   _flags_since_checked=None if blocking else torch.zeros(1, dtype=torch.int32, device=device))


def kernel_and_oracle(backend, routing: Routing, probs):
    got = HybridBackend._layout_tensors(backend, routing, probs)
    want = HybridBackend._layout_torch(backend, routing, probs)
    return got, want


def assert_bitwise(got, want, context) -> None:
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        if w is None:
            assert g is None, (name, context)
            continue
        assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device, (name, context)
        if g.dtype == torch.float32:  # bitwise, so -0.0 and NaN payloads count too
            g, w = g.view(torch.int32), w.view(torch.int32)
        assert torch.equal(g, w), (name, context)


# ---- routing generation (seeded, on the GPU) --------------------------------------------------------

def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def random_map(num_tokens: int, num_experts: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        density = torch.rand(1, generator=gen, device="cuda").item() * 0.5
        return torch.rand(num_tokens, num_experts, generator=gen, device="cuda") < density
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device="cuda")
    if kind == "expert0":
        routing_map[:, 0] = True
    return routing_map  # "none": no token routed anywhere


def random_topk(num_tokens: int, num_experts: int, topk: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Distinct ids per token, with -1 mixed in ("random"), all on expert 0, or all -1 ("none")."""
    if kind == "random":
        scores = torch.rand(num_tokens, num_experts, generator=gen, device="cuda")
        idx = scores.topk(topk, dim=1).indices
        drop = torch.rand(num_tokens, topk, generator=gen, device="cuda") < 0.2
        return idx.masked_fill(drop, -1).contiguous()
    idx = torch.full((num_tokens, topk), -1, dtype=torch.int64, device="cuda")
    if kind == "expert0":
        idx[:, 0] = 0
    return idx


def random_probs(shape, gen: torch.Generator) -> torch.Tensor:
    # Signed values, so that a -0.0 or a misplaced value shows up bitwise.
    return torch.randn(*shape, generator=gen, device="cuda")


# ---- kernel vs torch ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_ranks,num_local", RANKS_AND_LOCAL)
def test_routing_map_matches_torch(num_ranks, num_local):
    backend = stand_in(num_ranks, num_local)
    E = num_ranks * num_local
    for seed, (T, kind, with_probs) in enumerate(itertools.product(TOKENS, ("random", "expert0", "none"),
                                                                   (False, True))):
        gen = generator(1000 * num_ranks + 10 * num_local + seed)
        routing_map = random_map(T, E, kind, gen)
        probs = random_probs((T, E), gen) if with_probs else None
        got, want = kernel_and_oracle(backend, Routing(ROUTING_MAP, T, E, routing_map=routing_map), probs)
        assert_bitwise(got, want, (num_ranks, num_local, T, kind, with_probs))
        assert got[4] is probs  # the routing map's probs pass through


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("num_ranks,num_local", RANKS_AND_LOCAL)
def test_topk_matches_torch(num_ranks, num_local, blocking):
    backend = stand_in(num_ranks, num_local, blocking=blocking)
    E = num_ranks * num_local
    topks = sorted({1, min(2, E), min(8, E)} | ({40} if E >= 40 else set()))  # 40: the K > 32 path
    for seed, (T, topk, kind, with_probs) in enumerate(itertools.product(TOKENS, topks, ("random", "expert0", "none"),
                                                                         (False, True))):
        gen = generator(7 + 1000 * num_ranks + 10 * num_local + seed)
        idx = random_topk(T, E, topk, kind, gen)
        probs = random_probs((T, topk), gen) if with_probs else None
        got, want = kernel_and_oracle(backend, Routing(TOPK, T, E, topk_idx=idx), probs)
        assert_bitwise(got, want, (num_ranks, num_local, T, topk, kind, with_probs, blocking))
        assert not bool(got[5].any())  # distinct ids in range: nothing to flag


@pytest.mark.parametrize("num_ranks,num_local,topk", [(8, 32, 8), (2, 3, 4), (32, 1, 2), (2, 32, 40)])
def test_bad_ids_are_flagged_and_dropped(num_ranks, num_local, topk):
    backend = stand_in(num_ranks, num_local, blocking=False)
    E = num_ranks * num_local
    for T in (1, 7, 4096, 8193):
        gen = generator(31 * T + topk)
        idx = random_topk(T, E, topk, "random", gen)
        bad_values = torch.tensor([-2, -5, E, E + 3, 2**40, -(2**40)], device="cuda")
        where = torch.rand(T, topk, generator=gen, device="cuda") < 0.1
        where[T // 2, topk - 1] = True  # at least one
        pick = torch.randint(0, len(bad_values), (T, topk), generator=gen, device="cuda")
        idx = torch.where(where, bad_values[pick], idx).contiguous()
        probs = random_probs((T, topk), gen)
        got, want = kernel_and_oracle(backend, Routing(TOPK, T, E, topk_idx=idx), probs)
        assert_bitwise(got, want, (num_ranks, num_local, topk, T))
        assert bool((got[5] & backend._C.INPUT_ID_OUT_OF_RANGE).all())  # every rank's column carries it


def test_the_flags_of_every_dispatch_since_the_host_cleared_them_add_up():
    """Non-blocking mode's check_errors() reads one device word that every layout ORs its flags into:
    before, it read the last dispatch's flags alone, so a clean dispatch after a bad one hid it."""
    backend = stand_in(2, 3, blocking=False)
    E, T, k = 6, 64, 2
    clean = random_topk(T, E, k, "random", generator(5))
    bad = clean.clone()
    bad[3, 0] = E + 1
    repeated = clean.clone()
    repeated[7, 0] = repeated[7, 1] = 2  # token 7 names expert 2 twice
    seen = []
    for idx in (clean, bad, clean, repeated, clean):
        HybridBackend._layout_tensors(backend, Routing(TOPK, T, E, topk_idx=idx.contiguous()), None)
        seen.append(int(backend._flags_since_checked.item()))
    out_of_range, twice = backend._C.INPUT_ID_OUT_OF_RANGE, backend._C.INPUT_ID_REPEATED
    assert seen == [0, out_of_range, out_of_range, out_of_range | twice, out_of_range | twice], seen


@pytest.mark.parametrize("num_ranks,num_local,topk", [(8, 32, 8), (2, 3, 6), (32, 1, 8), (2, 32, 40), (1, 256, 64)])
def test_duplicate_ids_count_once_and_last_prob_wins(num_ranks, num_local, topk):
    """A token naming an expert twice chose it once, and the expert's rank column is flagged."""
    backend = stand_in(num_ranks, num_local, blocking=False)
    E = num_ranks * num_local
    for T in (1, 7, 4096):
        gen = generator(97 * T + topk)
        idx = torch.randint(-1, min(E, 12), (T, topk), generator=gen, device="cuda")  # many repeats
        probs = random_probs((T, topk), gen)
        routing = Routing(TOPK, T, E, topk_idx=idx)
        got, want = kernel_and_oracle(backend, routing, probs)
        expected_dense = torch.zeros(T, E + 1, device="cuda")
        rows = torch.arange(T, device="cuda")
        for k in range(topk):  # in slot order: the last slot naming an expert wins
            expected_dense[rows, torch.where(idx[:, k] >= 0, idx[:, k], E)] = probs[:, k]
        want = want[:4] + (expected_dense[:, :E].contiguous(), want[5])
        assert_bitwise(got, want, (num_ranks, num_local, topk, T))
        if T == 4096:  # surely some repeat: the flags name the ranks of the repeated experts (ids < 12)
            assert bool((got[5] & backend._C.INPUT_ID_REPEATED).any())


# ---- every element written, nothing past the end, vector and scalar paths ------------------------------

def run_extension(backend, routing: Routing, probs, misalign: int):
    """Call the extension directly; outputs start `misalign` elements into sentinel-filled buffers."""
    T, E, R, L = routing.num_tokens, backend.num_experts, backend.num_ranks, backend.num_local_experts
    buffers = []

    def output(count, dtype):
        fill = SENTINEL if dtype == torch.int32 else float("nan")
        flat = torch.full((misalign + count + CANARY,), fill, dtype=dtype, device="cuda")
        buffers.append((flat, misalign, count))
        return flat[misalign:misalign + count]

    send_slot, k_index = output(T * R, torch.int32).view(T, R), output(T * E, torch.int32).view(T, E)
    expert_counts, rank_counts = output(E, torch.int32), output(R, torch.int32)
    topk = routing.topk_idx.shape[1] if routing.form == TOPK else 0
    dense = output(T * E, torch.float32).view(T, E) if topk and probs is not None else None
    flags = output(R, torch.int32) if topk else None
    args = backend._C.LayoutArgs(
        routing_map=None if topk else routing.routing_map, topk_idx=routing.topk_idx if topk else None,
        probs=probs if topk else None, num_tokens=T, num_ranks=R, num_local_experts=L, topk=topk,
        send_slot=send_slot, k_index=k_index, expert_counts=expert_counts, rank_counts=rank_counts,
        dense_probs=dense, input_flags=flags)
    backend._C.layout(args, backend.device.index, backend._stream())
    for flat, start, count in buffers:  # canaries before and after each output
        outside = torch.cat([flat[:start], flat[start + count:]])
        untouched = outside.isnan() if flat.dtype == torch.float32 else outside == SENTINEL
        assert bool(untouched.all()), "the kernel wrote outside an output"
    return send_slot, k_index, expert_counts, rank_counts, dense if topk else probs, flags


@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("num_ranks,num_local", [(8, 32), (2, 256), (4, 4), (3, 3)])
def test_every_element_written_on_vector_and_scalar_paths(num_ranks, num_local, misalign):
    """misalign=1 moves the outputs (and the map) off 16-byte alignment: the scalar path runs."""
    backend = stand_in(num_ranks, num_local, blocking=False)
    E = num_ranks * num_local
    for T in (1, 7, 300, 4096):
        gen = generator(T + misalign)
        flat_map = torch.zeros(T * E + misalign, dtype=torch.bool, device="cuda")
        routing_map = flat_map[misalign:].view(T, E)
        routing_map.copy_(random_map(T, E, "random", gen))
        routing = Routing(ROUTING_MAP, T, E, routing_map=routing_map)
        assert_bitwise(run_extension(backend, routing, None, misalign), HybridBackend._layout_torch(
            backend, routing, None)[:5] + (None,), ("map", T, misalign))
        for topk in (1, min(8, E)):
            idx = random_topk(T, E, topk, "random", gen)
            probs = random_probs((T, topk), gen)
            routing = Routing(TOPK, T, E, topk_idx=idx)
            assert_bitwise(run_extension(backend, routing, probs, misalign),
                           HybridBackend._layout_torch(backend, routing, probs), ("topk", T, topk, misalign))


def test_rejects_inconsistent_arguments():
    ext = _cuda.extension()
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream
    counts = torch.empty(64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="num_ranks"):
        ext.layout(ext.LayoutArgs(num_ranks=33, num_local_experts=1, expert_counts=counts, rank_counts=counts),
                   device, stream)
    with pytest.raises(ValueError, match="num_local_experts"):
        ext.layout(ext.LayoutArgs(num_ranks=1, num_local_experts=257, expert_counts=counts, rank_counts=counts),
                   device, stream)
    with pytest.raises(ValueError, match="routing input"):
        ext.layout(ext.LayoutArgs(num_tokens=4, num_ranks=2, num_local_experts=2, k_index=counts,
                                  expert_counts=counts, send_slot=counts, rank_counts=counts), device, stream)
    with pytest.raises(TypeError, match="no field"):
        ext.LayoutArgs(num_rank=2)


# ---- CUDA graphs --------------------------------------------------------------------------------------

def test_layout_replays_in_a_cuda_graph():
    """Captured once, replayed on new routings: no host sync, no allocation, no state between launches."""
    R, L, T, topk = 8, 32, 128, 8
    E = R * L
    backend = stand_in(R, L, blocking=False)
    gen = generator(5)
    idx = random_topk(T, E, topk, "random", gen)
    probs = random_probs((T, topk), gen)
    routing = Routing(TOPK, T, E, topk_idx=idx)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        HybridBackend._layout_tensors(backend, routing, probs)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = HybridBackend._layout_tensors(backend, routing, probs)
    for replay in range(3):
        idx.copy_(random_topk(T, E, topk, "random", gen))
        probs.copy_(random_probs((T, topk), gen))
        if replay == 2:
            idx[3, 1] = E + 5  # a bad id is flagged on replay too
        graph.replay()
        assert_bitwise(outputs, HybridBackend._layout_torch(backend, routing, probs), replay)
