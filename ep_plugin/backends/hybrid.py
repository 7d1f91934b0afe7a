"""``hybrid``: compiled dispatch/combine within one NVLink domain (Megatron ``hybridep`` semantics).

Stages (each a kernel, run on the caller's current stream; one NVTX range per op,
``ep.hybrid.<op>``). The layout and the exchange are shared with the other compiled backend
(``csrc/layout.cu``, ``csrc/exchange.cu``); the data stages are hybrid's own (``csrc/hybrid/``),
over regions it lays out on the transport's symmetric buffer (``csrc/hybrid/hybrid.h``):

1. layout (``csrc/layout.cu``, one kernel, no host sync): from routing_map or topk_idx, each token's send
   slot at every destination rank (``send_slot [T, R]``: tokens sent to a rank are numbered in
   token order, -1 = none), its index within each chosen expert (``k_index [T, E]``), and the
   counts per expert and per destination rank.
2. exchange (in the layout's launch, run by its last block: ``_layout_and_exchange``; a handshake
   alone is a one-block kernel): advance the device-resident op number, push the counts into every
   peer's buffer, handshake (with the op fingerprint: ranks that disagree on the op get ``EPError``); derive this
   rank's receive layout (segment starts, row bases per (source, expert), padded
   ``tokens_per_expert``, total rows).
3. dispatch_send (``dispatch.cu``): each token is staged once, and each destination rank gets its
   index and per-local-expert k index and prob.
4. permute (``permute.cu``): each packet is pulled from its source and expands into its expert
   rows; padding zeroed. Non-blocking (the output size known before the counts), stages 3 and 4 run
   in one launch (``dispatch_fused``): each block sends its share, then permutes its share.
5. combine (``combine.cu``): the expert side sums a packet's rows (fp32, rounded once to bf16)
   and sends one row per (token, source rank) back; the source sums those in fp32. In place (the
   expert output already in the buffer's arena, see below), the source reads every expert row of
   its tokens where it is and sums them in one pass.

Row order of the dispatch output is the reference contract (local expert, source rank, source
token), bitwise equal to ``reference``. Combine tolerance: each expert rank's partial sum is
rounded to bf16 before the source adds the partials, so a token whose experts live on several
ranks can differ from the reference (which rounds once) by about one bf16 ulp per rank of the
result's magnitude (|err| <= R * 2**-8 * max|partial|); a token whose experts are all on one rank
matches exactly. An in-place combine adds all of a token's rows in fp32 and rounds once.

Combine in place (a backend built with ``combine_input_rows=N > 0``, or EP_PLUGIN_COMBINE_INPUT_ROWS=N):
the buffer then has a combine-input arena (``transport/arena.py``), and an expert output that lies there
is combined in place: with its arrival at the combine each rank tells the peers where its input lies in
its arena, and each source reads its tokens' expert rows straight from the expert ranks' arenas and
sums them (one pass: the rows are read once, no partial sums are written and read back), which on one
GPU moves about half the bytes of the two-stage combine. A rank whose input lies elsewhere pushes
partial sums as in the two-stage combine and says so instead; the sources add its partial where its
rows would go. So ranks need not agree, and a miss costs speed, never an error. ``combine_counts``
counts this rank's combines by kind ("in_place", "pushed").

Two ways to put the output there, one per backend (the first used takes the arena):
- ``combine_input(handle)``: the arena's first rows as a [num_rows, H] bf16 tensor, to write the expert
  output into (``out=``). One combine input at a time (combining it for a handle it was not last
  handed out for raises ``ValueError``, before any launch); valid from the dispatch of ``handle``
  until its combine; its address never changes, so CUDA graphs capture it. Refused (``ValueError``)
  right after an in-place combine, until another op ran: the peers may still read those rows.
- ``combine_input_arena()``: a context in which torch's caching allocator takes this thread's
  allocations from the arena (a ``torch.cuda.MemPool`` over it), so an output computed there by any
  torch op is in place; what does not fit gets ordinary memory. The peers read a rank's input until
  the next op of the backend, so the context routes nothing (yields False) between an in-place combine
  and the next op, and a combine inside a routing context is refused. torch gives a pool segment's
  blocks to one stream: the arena serves the stream that was current when it was last empty.
  Megatron's SequentialMLP experts allocate their output this way (``integrations/megatron``).

``N`` sizes the arena for the largest combine input expected (the largest blocking output, or
``num_permuted_tokens`` in non-blocking mode; ``worst_case_rows(...)`` always fits): at most ``N * 2H``
bytes per rank plus 12 MiB for the allocator's segment rules (``arena_bytes``).

Blocking mode (``config.blocking``): the output has exactly the received rows; the host reads the
total from pinned memory owned by the buffer after waiting (with a timeout) on an event recorded
after the notify kernel, while the send (enqueued before the wait) runs. The same read tells every
rank whether any rank's top-k ids were out of range or repeated, or a rank had more tokens than
``max_tokens_per_rank`` (it ran the op with none): then every rank raises ``ValueError`` and nothing
is permuted. Non-blocking mode: the output has ``num_permuted_tokens`` rows (0 = the
worst case), counts stay on the device, rows past the budget are dropped and raise
``handle.layout.overflow`` (also ``backend.over_budget``); nothing syncs, so dispatch and combine
can be captured in a CUDA graph (the op number advances on the device at each replay).

Valid output in non-blocking mode: rows ``[0, min(sum(tokens_per_expert), budget))`` (padding rows
inside a segment are zero); rows past that are left unwritten. ``tokens_per_expert`` is not
clipped: when ``overflow`` is set the segments that did not fit were dropped.

Timeouts and disagreement: every device wait gives up after ``config.timeout_s``, writes rank /
phase / peer / counters to mapped host memory and exits (no trap, so the process stays usable);
a handshake that sees a peer enter a different op (kind, dtype, probs, routing form, top-k, or
another dispatch's handle) reports that instead. The host raises ``EPTimeoutError`` / ``EPError``
with the report at its next sync point (blocking dispatch, barrier) or the next call. After
either the backend is unusable (its op numbers no longer agree with its peers'): build a new one.
``check_errors()`` syncs and raises what is pending.

Rules and limits:
- Every op (dispatch, combine, dispatch_again) starts with a handshake of all ranks, so all
  ranks must issue the same ops in the same order, one op in flight per backend (one stream).
- FP8: ``backend.dispatch((data [T, H] float8_e4m3fn, scales [T, H/128] float32), ...)`` returns
  ``hidden`` as ``(rows [R, H] fp8, row_scales [R, H/128])``; padding rows have zero data and
  scales. FP8 goes through ``backend.dispatch`` only (not the autograd ``ep_plugin.dispatch``);
  combine and dispatch_again of its handle are bf16.
- Buffer per rank: about ``R * max_tokens_per_rank * (4 * H + 12 * L)`` bytes (dispatch packets,
  their k/prob metadata, combine rows), plus the arena (``arena_bytes(combine_input_rows * 2H)``);
  up to 32 ranks and 256 local experts; H % 8 == 0.
- Co-residency: (ranks sharing a GPU) x num_sms must not exceed the GPU's SMs
  (``max_sms_per_gpu`` overrides the detected count); the constructor refuses otherwise.
"""

from __future__ import annotations

import collections
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .. import streams
from ..agreement import OP_COMBINE, OP_DISPATCH, OP_DISPATCH_AGAIN, TOPK_FIELD_MAX, fingerprint_code
from ..config import Config, is_int
from ..handle import CombineOutput, DispatchOutput, Handle
from ..routing import ROUTING_MAP, Routing, route_counts
from ..transport.arena import CombineInputArena, arena_bytes
from .base import Capabilities, check_pad_multiple
from .compiled import CompiledBackend, Scratch, earlier_repeats, nvtx_range, op_range, worst_case_rows

logger = logging.getLogger(__name__)

PHASE_NAMES = {
    1: "dispatch/notify (handshake + count exchange)",
    2: "combine/handshake",
    3: "dispatch_again/handshake (backward of combine)",
    4: "dispatch/receive (waiting for tokens)",
    5: "combine/receive (waiting for expert rows)",
    6: "barrier",
}
PHASE_DISPATCH, PHASE_COMBINE, PHASE_DISPATCH_AGAIN, PHASE_BARRIER = 1, 2, 3, 6
# The int64 counts a dispatch hands out, adjacent in its scratch so one split views them all.
HANDED_OUT_COUNTS = ("tokens_per_expert", "real_per_expert", "total_rows")


@dataclass(eq=False)
class HybridLayout:
    """What combine and both backwards read of one dispatch (owned by the Handle).

    The device tensors are pieces of ``scratch`` (kernels take their addresses; ``scratch.tensor(name)``
    gives a view): send_slot [T, R] int32 (packet slot at each rank, -1 = not sent), k_index [T, E]
    int32 (index of the token within (this rank, expert), -1 = not routed), row_base [R, L] int32
    (first output row of (source rank, local expert)), expert_start [L] int32, num_packets [R] int32
    (packets received from each source), packet_rows [R * max_tokens, L] int32 (output row of each
    received (packet, expert)), and with combine_input_rows > 0 peer_rows [R, L + 1] int32 (see
    ExchangeArgs.peer_row_base).
    """

    scratch: Scratch
    topk_idx: Optional[torch.Tensor]  # [T, k] int64 of a top-k dispatch (to shape the probs gradient)
    total_rows: torch.Tensor  # [1] int64: sum of padded segment lengths
    overflow: torch.Tensor  # [1] int32: 1 when rows fell past the budget (non-blocking)
    input_flags: Optional[torch.Tensor]  # [R] int32 (top-k form): bad ids seen by the layout (see _layout)
    budget: int  # rows of the dispatch output
    fp8: bool
    repeats_dropped: bool = False  # non-blocking: a repeated expert counted at its last slot only (not refused)
    combine_input: Optional[weakref.ref] = None  # the tensor combine_input() handed out for this handle

    @property
    def in_place_ready(self) -> bool:
        """Whether the dispatch derived the peers' row bases an in-place combine reads."""
        return self.scratch.has("peer_rows")


class HybridBackend(CompiledBackend):
    """CUDA dispatch/combine over symmetric buffers; ranks may share a GPU (several processes) or not."""

    name = "hybrid"
    capabilities = Capabilities(
        devices=("cuda",),
        hidden_dtypes=(torch.bfloat16,),
        probs_dtypes=(torch.float32,),
        fp8_dispatch=True,
        non_blocking=True,
        cuda_graphs=True,
    )
    phase_names = PHASE_NAMES
    barrier_phase = PHASE_BARRIER
    has_combine_input_arena = True  # built with combine_input_rows (see the module docstring)

    @classmethod
    def check_build_arguments(cls, group=None, *, combine_input_rows: Optional[int] = None, **kwargs) -> None:
        super().check_build_arguments(group, combine_input_rows=combine_input_rows, **kwargs)
        if combine_input_rows is None:
            return
        if not is_int(combine_input_rows):
            raise TypeError(f"combine_input_rows must be an int, got {combine_input_rows!r}")
        if combine_input_rows < 0:
            raise ValueError(f"combine_input_rows must be >= 0, got {combine_input_rows}")

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None, topology=None,
                 combine_input_rows: Optional[int] = None) -> None:
        """Args as every backend, plus ``combine_input_rows``: room in the buffer's combine-input arena for
        a combine input of that many rows (0 = no arena, no in-place combine; None = the config's
        ``combine_input_rows``, whose env override is EP_PLUGIN_COMBINE_INPUT_ROWS; see the module
        docstring). Equal on every rank."""
        if combine_input_rows is None:  # an explicit one was checked in __new__ (check_build_arguments)
            combine_input_rows = (config if config is not None else Config.from_env()).combine_input_rows
        self.combine_input_rows = combine_input_rows  # before the base constructor: its check includes it
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device,
                         topology=topology)
        self.regions = self._C.hybrid.Regions(num_ranks=self.num_ranks, max_tokens=self.config.max_tokens_per_rank,
                                              hidden=hidden_size, num_local_experts=self.num_local_experts,
                                              max_blocks=self.num_blocks,
                                              combine_input_bytes=arena_bytes(combine_input_rows * 2 * hidden_size))
        self._open_buffer(self.regions.total_bytes, self.regions.count_words)
        self.over_budget: Optional[torch.Tensor] = None  # overflow flag of the latest dispatch
        self.arena: Optional[CombineInputArena] = None
        if combine_input_rows:
            self.arena = CombineInputArena(self._C, self.device, self.buffer.raw.region_address +
                                           self.regions.off_comb_input, self.regions.combine_input_bytes)
        # Combines by how this rank's input travelled: "in_place" (read in the arena) or "pushed".
        self.combine_counts: collections.Counter = collections.Counter()
        self._arena_contexts = 0  # routing combine_input_arena() contexts open on this backend
        self._arena_use: Optional[str] = None  # who took the arena: "combine_input" or "pool" (the context)

    def _construction_facts(self) -> dict:
        # It sizes a region of the buffer, whose offsets must be equal on every rank.
        return {**super()._construction_facts(), "combine_input_rows": self.combine_input_rows}

    worst_case_rows = staticmethod(worst_case_rows)  # compiled.worst_case_rows, kept on the class for users

    @classmethod
    def in_place_options(cls, *, num_ranks: int, max_tokens_per_rank: int, num_experts: int, topk: int,
                         pad_multiple: int = 1) -> dict:
        """Constructor options that let every dispatch of that shape (padded to ``pad_multiple``) be combined
        in place."""
        check_pad_multiple(pad_multiple)
        local = num_experts // num_ranks
        return {"combine_input_rows": cls.worst_case_rows(num_ranks, max_tokens_per_rank, local, topk, pad_multiple)}

    @classmethod
    def wire_bytes(cls, routing_maps, num_ranks, *, row_bytes, hidden, topk, with_probs, combine_in_place=False,
                   **options):
        """Each token goes once per remote rank holding any of its experts, with L x (int32 k index + fp32
        prob) that the kernel always fills; combine returns one bf16 row per such packet, plus L x fp32
        when probs come back. In place (``combine_in_place``) the source reads every remote expert row
        of its tokens instead (one bf16 row per (token, remote expert)), and the L x fp32 still travel
        per packet. Output rows: one per (token, local expert). See ``Backend.wire_bytes``."""
        packets, rows = route_counts(routing_maps, num_ranks)
        local = routing_maps[0].shape[1] // num_ranks
        probs_back = 4 * local if with_probs else 0
        totals = cls._wire_totals(rows, packets, row_bytes + 8 * local, (0 if combine_in_place else 2 * hidden)
                                  + probs_back)
        if combine_in_place:
            rows_read = cls._wire_totals(rows, rows, 0, 2 * hidden)["combine"]
            totals["combine"] = [a + b for a, b in zip(totals["combine"], rows_read, strict=True)]
        return totals

    # ---- stages ----------------------------------------------------------------------

    def _worst_case_rows(self, routing: Routing, pad_multiple: int) -> int:
        per_token = self.num_local_experts if routing.form == ROUTING_MAP else routing.topk_idx.shape[1]
        return self.worst_case_rows(self.num_ranks, self.config.max_tokens_per_rank, self.num_local_experts,
                                    per_token, pad_multiple)

    # ---- Backend protocol ---------------------------------------------------------------

    def _fingerprint(self, op: str, *, dtype=torch.bfloat16, probs: bool = False, routing: Optional[Routing] = None,
                     handle: Optional[Handle] = None) -> int:
        """The op's packed fingerprint (``agreement.fingerprint_code``), as the handshake takes it."""
        topk = routing.topk_idx.shape[1] if routing is not None and routing.form != ROUTING_MAP else 0
        return fingerprint_code(op, dtype, probs, routing.form if routing is not None else None,
                                min(topk, TOPK_FIELD_MAX), handle.handle_id if handle is not None else 0,
                                self.op_records_backward, self.op_probs_need_grad)

    def _dispatch_fields(self, routing: Routing, probs) -> list[tuple]:
        """The scratch pieces of a dispatch: the layout's, the count exchange's, the permute's."""
        R, L = self.num_ranks, self.num_local_experts
        fields = self.layout_fields(routing, probs, R) + [
            ("tokens_per_expert", (L,), torch.int64), ("real_per_expert", (L,), torch.int64),
            ("total_rows", (1,), torch.int64), ("row_base", (R, L), torch.int32), ("expert_start", (L,), torch.int32),
            ("num_packets", (R,), torch.int32), ("overflow", (1,), torch.int32),
            ("packet_rows", (R * self.config.max_tokens_per_rank, L), torch.int32)]
        if self.combine_input_rows:  # where this rank's tokens land in every rank's output (in-place combine)
            fields.append(("peer_rows", (R, L + 1), torch.int32))
        return fields

    def _dispatch_outputs(self, rows: int, dtype: torch.dtype, fp8: bool, with_probs: bool) -> tuple:
        """A dispatch's (rows [rows, H] of ``dtype``, fp8 scales or None, probs or None), uninitialized."""
        H = self.hidden_size
        return (self._empty(rows, H, dtype=dtype),
                self._empty(rows, H // self.FP8_BLOCK, dtype=torch.float32) if fp8 else None,
                self._empty(rows, dtype=torch.float32) if with_probs else None)

    @op_range("dispatch")
    def _dispatch(self, hidden, routing: Routing, probs, pad_multiple) -> DispatchOutput:
        self.buffer.raise_if_failed()
        hidden, routing, probs, refused = self._within_budget(hidden, routing, probs)  # every rank refuses
        fp8 = isinstance(hidden, (tuple, list))
        data, scales = (hidden[0], hidden[1]) if fp8 else (hidden, None)
        data = self._aligned(data)
        T, H, L = routing.num_tokens, self.hidden_size, self.num_local_experts
        # Non-blocking: the budget is known now (and tells peers which of their rows were dropped).
        budget = None if self.config.blocking else (
            self.config.num_permuted_tokens or self._worst_case_rows(routing, pad_multiple))
        scratch = self._scratch(("dispatch", T, routing.form, probs is not None),
                                lambda: self._dispatch_fields(routing, probs))
        at = scratch.address
        fingerprint = self._fingerprint(OP_DISPATCH, dtype=data.dtype, probs=probs is not None, routing=routing)
        # Non-blocking: the outputs before any launch (an allocation that fails leaves the peers untouched).
        outputs = None if budget is None else self._dispatch_outputs(budget, data.dtype, fp8, probs is not None)
        dense_probs = self._layout_and_exchange(
            routing, probs, scratch, PHASE_DISPATCH, fingerprint, pad_multiple=pad_multiple,
            receive_budget=budget, refused=refused,
            addresses=lambda: dict(row_base=at("row_base"), expert_start=at("expert_start"),
                                   tokens_per_expert=at("tokens_per_expert"),
                                   real_per_expert=at("real_per_expert"), num_packets=at("num_packets"),
                                   total_rows=at("total_rows"),
                                   peer_row_base=at("peer_rows") if self.combine_input_rows else None))
        counted = self._mark() if self.config.blocking else None
        # The send needs no host count: in blocking mode it runs while the host reads the counts, and
        # in non-blocking mode (the budget known) it shares one launch with the permute.
        row_bytes = H if fp8 else 2 * H
        scale_bytes = H // self.FP8_BLOCK * 4 if fp8 else 0
        self._keep_on_stream(data, scales, routing.routing_map, routing.topk_idx, probs)  # the layout read the last 3
        # The send zeroes the overflow flag, the permute sets it. Both structs are built once per plan
        # and address (Scratch.args; fp8 decides the row sizes); the op's own tensors and budget are set here.
        send = scratch.args(("send", fp8), lambda: self._C.hybrid.SendArgs(
            row_bytes=row_bytes, scale_bytes=scale_bytes, send_slot=at("send_slot"), k_index=at("k_index"),
            num_tokens=T, bulk_copy=self._bulk, overflow=at("overflow")))
        send.hidden, send.scales, send.probs = data, scales, dense_probs
        tokens_list = None  # blocking mode: the padded counts, read with the total
        if self.config.blocking:
            self._C.hybrid.dispatch_send(self.buffer.raw, self.regions, send, self.num_blocks, self._stream())
            with nvtx_range("ep.hybrid.dispatch.wait_count"):
                words = self._dispatch_counts(counted, routing, refused)
                budget, tokens_list = words[self._C.MAILBOX_TOTAL_ROWS], words[self._C.MAILBOX_EXPERT_ROWS:]
        out, out_scales, out_probs = outputs or self._dispatch_outputs(budget, data.dtype, fp8, probs is not None)
        permute = scratch.args(("permute", fp8), lambda: self._C.hybrid.PermuteArgs(
            row_bytes=row_bytes, scale_bytes=scale_bytes, row_base=at("row_base"), expert_start=at("expert_start"),
            tokens_per_expert=at("tokens_per_expert"), real_per_expert=at("real_per_expert"),
            num_packets=at("num_packets"), total_rows=at("total_rows"), packet_rows=at("packet_rows"),
            overflow=at("overflow"), bulk_copy=self._bulk))
        permute.out, permute.out_scales, permute.out_probs, permute.budget = out, out_scales, out_probs, budget
        if self.config.blocking:
            self._C.hybrid.permute(self.buffer.raw, self.regions, permute, self.num_blocks, self._stream())
        else:
            self._C.hybrid.dispatch_fused(self.buffer.raw, self.regions, send, permute, self.num_blocks,
                                          self._stream())
        # Views only of what is handed out: the handle's counts, the flags, the valid-row count.
        tokens_per_expert, real_per_expert, total_rows = scratch.tensors(HANDED_OUT_COUNTS)
        overflow = scratch.tensor("overflow")
        input_flags = scratch.tensor("input_flags") if scratch.has("input_flags") else None
        layout = HybridLayout(scratch=scratch, topk_idx=routing.topk_idx if routing.form != ROUTING_MAP else None,
                              total_rows=total_rows, overflow=overflow, input_flags=input_flags, budget=budget,
                              fp8=fp8, repeats_dropped=not self.config.blocking)
        handle = Handle(
            backend=self, num_tokens=T, hidden_size=H, hidden_dtype=torch.bfloat16,
            probs_shape=routing.probs_shape if probs is not None else None, num_experts=self.num_experts,
            num_local_experts=L, pad_multiple=pad_multiple, num_rows=budget, tokens_per_expert=tokens_per_expert,
            num_real_tokens_per_expert=real_per_expert, layout=layout,
            handle_id=self._next_handle_id())
        self.over_budget = overflow
        rows = (out, out_scales) if fp8 else out
        return DispatchOutput(rows, out_probs, tokens_per_expert, handle,
                              num_valid_rows=None if self.config.blocking else total_rows,
                              tokens_per_expert_list=tokens_list, ready=streams.record_ready(self.device))

    def _valid_rows_of(self, handle: Handle) -> Optional[torch.Tensor]:
        return None if self.config.blocking else handle.layout.total_rows

    @op_range("dispatch_again")
    def _dispatch_again(self, hidden, handle: Handle) -> torch.Tensor:
        self.buffer.raise_if_failed()
        layout: HybridLayout = handle.layout
        at = layout.scratch.address
        H = self.hidden_size
        hidden = self._aligned(hidden)
        fingerprint = self._fingerprint(OP_DISPATCH_AGAIN, dtype=hidden.dtype, handle=handle)
        out = self._empty(layout.budget, H, dtype=hidden.dtype)  # before any launch (see _combine)
        self._exchange(PHASE_DISPATCH_AGAIN, fingerprint)
        self._keep_on_stream(hidden)
        self._keep_layout_on_stream(layout.scratch.memory)  # the handle may go before this op has run
        send = self._C.hybrid.SendArgs(hidden=hidden, row_bytes=2 * H, send_slot=at("send_slot"),
                                       num_tokens=handle.num_tokens, bulk_copy=self._bulk)
        self._C.hybrid.dispatch_send(self.buffer.raw, self.regions, send, self.num_blocks, self._stream())
        permute = self._C.hybrid.PermuteArgs(
            out=out, row_bytes=2 * H, budget=layout.budget, row_base=at("row_base"),
            expert_start=at("expert_start"), tokens_per_expert=at("tokens_per_expert"),
            real_per_expert=at("real_per_expert"), num_packets=at("num_packets"),
            total_rows=at("total_rows"), packet_rows=at("packet_rows"), use_cached_rows=True,
            overflow=at("overflow"), bulk_copy=self._bulk)
        self._C.hybrid.permute(self.buffer.raw, self.regions, permute, self.num_blocks, self._stream())
        return out

    @contextmanager
    def combine_input_arena(self) -> Iterator[bool]:
        """Inside, this thread's CUDA allocations come from the combine-input arena while it has room, so
        that an expert output computed there (by any torch op) is combined in place.

        Yields whether allocations go to the arena: not on a backend without one
        (``combine_input_rows=0``), whose torch cannot pool it (``arena.unusable_reason``) or whose
        arena ``combine_input`` took (the two ways exclude each other on one backend), and not while
        the peers may still read this rank's last combine input there (an in-place combine with no
        op of this backend since: open the context after the dispatch whose output you compute).
        What lands elsewhere is combined the two-stage way. Combining inside a routing context
        raises ValueError: a block freed there could be handed out again while the peers read it.
        The memory goes with ``destroy()``.
        """
        if self.arena is None or self._peers_may_read_arena or self._arena_use == "combine_input":
            yield False
            return
        with self.arena.allocating() as usable:
            if usable:
                self._arena_use = "pool"
                self._wait_for_queued_ops()  # what is allocated there is written on this stream
            self._arena_contexts += usable
            try:
                yield usable
            finally:
                self._arena_contexts -= usable

    def combine_input(self, handle: Handle) -> torch.Tensor:
        """The combine input of ``handle`` inside this rank's buffer: [num_rows, H] bf16, in the row order
        of the dispatch output (the first rows of the combine-input arena; see the module docstring).

        Write the expert output there and pass this tensor to ``combine(rows, handle)``: the sources
        then read each row where it is. Valid from the dispatch of ``handle`` until its combine; the
        buffer holds one combine input at a time (combining it for another handle raises ValueError),
        and the memory goes with ``destroy()``. Its address never changes, so CUDA graphs may capture
        it. A backend whose arena ``combine_input_arena()`` routes allocations to refuses it
        (ValueError): allocate the output inside that context instead.
        """
        self.refuse_if_destroyed("combine_input")
        self.check_handle(handle)
        room = self.combine_input_rows
        if handle.num_rows > room or room == 0:  # (none: refused for an empty output too, as on every rank)
            built = ("was built without room for it (combine_input_rows=0)" if room == 0 else
                     f"has room for {room} (combine_input_rows)")
            raise ValueError(f"combine_input: this dispatch output has {handle.num_rows} rows but the backend "
                             f"{built}; build it with combine_input_rows >= {handle.num_rows} (worst_case_rows() "
                             "always fits), or combine a tensor of your own")
        if self._arena_use == "pool":
            raise ValueError("combine_input: this backend's combine-input arena serves combine_input_arena(), whose "
                             "allocations may lie anywhere in it; allocate the expert output inside that context")
        view = self._combine_input_view(handle.layout, self.regions.off_comb_input, handle.num_rows)
        self._arena_use = "combine_input"  # once handed out (a refused call leaves the arena to the pool route)
        self._wait_for_queued_ops()  # the caller writes there next, on its stream
        return view

    def destroy(self) -> None:
        try:
            if self.arena is not None and self.arena.destroy():
                self.keep_buffer_memory = True
                logger.warning("ep_plugin hybrid: a tensor of the combine-input arena outlived its backend: the "
                               "buffer (%.2f GiB) stays allocated until the process ends",
                               self.buffer.total_bytes / 2**30)
        finally:
            super().destroy()

    def _arena_offset(self, rows: torch.Tensor, layout: "HybridLayout") -> Optional[int]:
        """Where ``rows`` lie in this rank's arena (then the peers read them there), or None (raises
        ValueError for ``combine_input`` rows handed out for another dispatch, see there)."""
        if self.arena is None or not layout.in_place_ready:
            return None
        if self._arena_use == "combine_input":
            return 0 if self._is_combine_input(rows, layout, self.regions.off_comb_input) else None
        return self.arena.offset_of(rows)

    @op_range("combine")
    def _combine(self, rows, handle: Handle, row_probs) -> CombineOutput:
        self.buffer.raise_if_failed()
        if self._arena_contexts:
            raise ValueError("combine inside combine_input_arena(): leave the context first (a block freed in it "
                             "could be handed out again while the peers read it)")
        layout: HybridLayout = handle.layout
        at = layout.scratch.address
        T, dev = handle.num_tokens, self.device
        # Mid-word rows become a copy before any launch (a copy is never in the arena: its combine pushes).
        rows = self._aligned(rows)
        offset = self._arena_offset(rows, layout)
        in_place = offset is not None
        # With an arena every rank tells the others where its input lies, or that it pushes partial
        # sums (so ranks may differ); each source reads the rows in place, or the partial.
        op_word = None if not layout.in_place_ready else (
            offset // 16 if in_place else self._C.hybrid.COMBINE_PUSHED)
        # The outputs before the first launch: an allocation that fails then leaves the ranks in step.
        out = torch.empty(T, self.hidden_size, dtype=torch.bfloat16, device=dev)
        dense_probs = torch.zeros(T, self.num_experts, dtype=torch.float32, device=dev) \
            if row_probs is not None else None
        self._exchange(PHASE_COMBINE, self._fingerprint(OP_COMBINE, dtype=rows.dtype, probs=row_probs is not None,
                                                        handle=handle), op_word=op_word, input_read_in_place=in_place)
        self.combine_counts["in_place" if in_place else "pushed"] += 1
        # In place the sources read the rows in the buffer: only the scalars (if any) travel ahead.
        send_needed = not in_place or row_probs is not None
        # The handle may go before this op has run (topk_idx: the values routed back are gathered by it).
        self._keep_on_stream(rows, row_probs)
        self._keep_layout_on_stream(layout.scratch.memory, layout.topk_idx if row_probs is not None else None)
        # Structs built once per plan and address (Scratch.args); the op's own fields are set on every call.
        scratch = layout.scratch
        if send_needed:
            send = scratch.args("combine_send", lambda: self._C.hybrid.CombineSendArgs(
                packet_rows=at("packet_rows"), num_packets=at("num_packets")))
            send.rows, send.row_probs, send.budget = None if in_place else rows, row_probs, layout.budget
            self._C.hybrid.combine_send(self.buffer.raw, self.regions, send, self.num_blocks, self._stream())
        # peer_rows: the dispatch derived them (layout.in_place_ready), so the combine sends an op word.
        receive = scratch.args("combine_recv", lambda: self._C.hybrid.CombineRecvArgs(
            send_slot=at("send_slot"), k_index=at("k_index"), num_tokens=T,
            peer_rows=at("peer_rows") if op_word is not None else None))
        receive.out, receive.out_probs, receive.wait_for_send = out, dense_probs, send_needed
        self._C.hybrid.combine_recv(self.buffer.raw, self.regions, receive, self.num_blocks, self._stream())
        probs = None
        if dense_probs is not None:
            if layout.topk_idx is None:
                probs = dense_probs
            else:
                idx = layout.topk_idx
                valid = (idx >= 0) & (idx < self.num_experts)
                if layout.repeats_dropped:  # the dispatch's mode, whatever the config says now
                    valid &= ~earlier_repeats(idx)
                # where(), not a product with the mask: an inf gathered for a dropped slot would give NaN there
                gathered = dense_probs.gather(1, torch.where(valid, idx, torch.zeros_like(idx)))
                probs = torch.where(valid, gathered, torch.zeros_like(gathered))
        return CombineOutput(out, probs)
