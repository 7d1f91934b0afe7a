"""``elastic``: compiled dispatch/combine with DeepEP V2 (``ElasticBuffer``) semantics, in one NVLink domain.

What a DeepEP user knows, under our names (DeepEP's in parentheses):

- ``dispatch(x | (x_fp8, scales), topk_idx=[T, k] int64 (-1 = none), topk_weights=[T, k] float32 or None,
  pad_multiple (expert_alignment), expand=False (do_expand), zero_padding=False (do_zero_padding),
  handle=None (cached dispatch))`` returns a ``DispatchOutput``:

  - compact form (default): ``hidden`` (recv_x) has one row per (token, this rank), ordered by source
    rank, then source token; ``topk_idx`` (recv_topk_idx) [R, k] holds the token's experts as this
    rank's local ids, -1 where the expert lives elsewhere; ``probs`` (recv_topk_weights) [R, k], 0
    where -1.
  - expanded form (``expand=True``): one row per (token, local expert), grouped by expert, each
    expert's segment padded to ``pad_multiple``, in (local expert, source rank, source token) order —
    the row order of ``reference`` and ``hybrid``; ``probs`` [R] is each row's weight; padding rows
    are zeroed only with ``zero_padding=True`` (else left as they are).
  - ``tokens_per_expert`` [L] int64 on the device (padded segment lengths, in both forms);
    ``tokens_per_expert_list`` on the host in blocking mode.

- Blocking mode (``config.blocking``, DeepEP's CPU sync): outputs have exactly the received rows; the
  host reads the count from memory the buffer owns, after an event wait with a timeout. Non-blocking
  mode: outputs have the worst-case rows (compact ``R * max_tokens_per_rank``; expanded
  ``align(R * max_tokens_per_rank * min(k, L) + (align - 1) * L, align)``), ``num_valid_rows`` [1]
  int64 on the device says how many are valid, rows past it are left unwritten, and nothing syncs:
  dispatch and combine can be captured in a CUDA graph. A consumer on another stream calls
  ``out.use_on(stream)`` (wait for the ready event, then ``record_stream`` every output storage).
- ``combine(rows, handle, row_probs=None, bias=None)`` returns [T, H] bf16: the unweighted fp32 sum of
  the token's rows over the ranks it went to (plus ``bias`` [T, H]), rounded once per token; with
  ``row_probs`` (shaped like the dispatched ``probs``) the values are routed back to [T, k]. The
  expanded form first sums a packet's rows on the expert rank (fp32, rounded to bf16): there a token
  whose experts live on several ranks can differ from an all-fp32 sum by about one bf16 ulp per rank.
- ``dispatch(..., in_place=True)`` (compact form, first dispatch; the backend built with
  ``in_place_dispatch=True``): the sources write each row straight into this rank's buffer and
  ``hidden`` (and FP8 scales) are views of it, so the payload crosses once instead of being staged
  and pulled. The rows are valid until the next in-place dispatch on this backend, which overwrites
  them (also when it is then refused for bad ids or a rank's token count: the rows are pushed before
  the count read).
  DeepEP's low-latency receive buffers work the same way. Copy what must live longer (e.g. rows
  saved for a backward). Metadata, counts and the handle are ordinary tensors.
- ``combine_input(handle)`` (compact form): a [rows, H] bf16 tensor inside the backend's buffer. Write
  the expert output there and pass that tensor to ``combine``: the sources then read the rows where
  they are instead of receiving a copy (DeepEP's low-latency combine buffer, for the normal kernels).
  It is valid from the dispatch of ``handle`` until that handle's combine; any other op on the
  backend in between may overwrite it, and a combine of it for a handle it was not last handed out
  for raises ``ValueError`` (before any launch), as does ``combine_input`` right after an in-place
  combine until another op ran (the peers may still read those rows). Ranks must agree on whether a
  combine is in place (the handshake checks it).
- Backward of dispatch is combine; backward of combine is a cached dispatch, through
  ``ep_plugin.dispatch`` / ``ep_plugin.combine``.

Stages (each a kernel on the caller's current stream; one NVTX range per op, ``ep.elastic.<op>``):
the send-side layout (``csrc/layout.cu``) and the count exchange with the op handshake
(``csrc/exchange.cu``), both shared with ``hybrid``; then elastic's own (``csrc/elastic/``): send
(stage each token once, push its per-destination metadata), receive (pull each packet into its row
or rows), and for combine: send (each packet's row or row sum back to its source) and receive (sum
per token).

Rules and limits: ranks must agree on every op (kind, dtype, probs, top-k, form, handle; the
handshake checks it and a mismatch raises ``EPError`` on every rank at its next sync point); one op
in flight per backend; ``max_tokens_per_rank`` (config) and ``max_topk`` (<= 32) are equal on every
rank; up to 32 ranks and 256 local experts; H % 8 == 0 (FP8: H % 128 == 0). Co-residency as in
``hybrid``: (ranks sharing a GPU) x num_sms <= SMs. Top-k ids are checked on the device: the layout
kernel flags ids outside [-1, E) and experts named twice in a token, and the count exchange tells
every rank. Blocking mode then raises ``ValueError`` on every rank at its one host read (no rows are
handed out; the backend stays usable); non-blocking mode drops such ids (a repeated expert counts
once, its last slot) and ``check_errors()`` reports ids out of range.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from .. import streams
from ..agreement import OP_COMBINE, OP_COMBINE_IN_PLACE, OP_DISPATCH, OP_DISPATCH_AGAIN, fingerprint_code
from ..config import is_int
from ..handle import COMPACT, EXPERT_ROWS, CombineOutput, DispatchOutput, Handle
from ..routing import ROUTING_MAP, TOPK, Routing, check_tensor, route_counts
from .base import Capabilities, merge_alignment
from .compiled import CompiledBackend, Scratch, nvtx_range, op_range

PHASE_NAMES = {
    1: "dispatch/exchange (handshake + count exchange)",
    2: "combine/handshake",
    3: "cached dispatch/handshake (backward of combine)",
    4: "dispatch/receive (waiting for tokens)",
    5: "combine/receive (waiting for expert rows)",
    6: "barrier",
}
PHASE_DISPATCH, PHASE_COMBINE, PHASE_CACHED, PHASE_BARRIER = 1, 2, 3, 6
# The int64 counts a dispatch hands out, adjacent in its scratch so one split views them all.
HANDED_OUT_COUNTS = ("tokens_per_expert", "real_per_expert", "total_rows", "total_packets")


@dataclass(eq=False)
class ElasticLayout:
    """What combine, cached dispatches and both backwards read of one dispatch.

    The device tensors of the layout and the count exchange are pieces of ``scratch`` (kernels take
    their addresses; ``scratch.tensor(name)`` gives a view): send_slot [T, R] int32 (packet slot at
    each rank, -1 = not sent), num_packets [R] int32 (packets received from each source), row_base
    [R, L] int32 (first expanded row of (source rank, local expert)), expert_start [L] int32, and in
    the compact form dest_base [R] int32 (row of this rank's first packet at each rank).
    """

    scratch: Scratch
    topk_idx: torch.Tensor  # [T, k] int64: the source's top-k ids (routing weights back)
    total_packets: torch.Tensor  # [1] int64: compact rows
    total_rows: torch.Tensor  # [1] int64: expanded rows (segments padded)
    packet_rows: Optional[torch.Tensor]  # expanded: [packets, k] int32 row of each (packet, slot), -1
    input_flags: Optional[torch.Tensor]  # [R] int32: bad top-k ids seen by the layout (see _layout)
    topk: int
    expand: bool
    zero_padding: bool
    capacity: int  # rows of the dispatch output
    combine_input: Optional[weakref.ref] = None  # the tensor combine_input() handed out for this handle


class ElasticBackend(CompiledBackend):
    """DeepEP V2 semantics (compact or expanded receive, cached dispatch) over symmetric buffers."""

    name = "elastic"
    capabilities = Capabilities(
        devices=("cuda",),
        hidden_dtypes=(torch.bfloat16,),
        probs_dtypes=(torch.float32,),
        fp8_dispatch=True,
        non_blocking=True,
        cuda_graphs=True,
        routing_forms=("topk",),
        dispatch_options=("expand", "zero_padding", "in_place"),
        cached_dispatch_options=("expand", "zero_padding"),
        cached_fp8=True,
        combine_options=("bias",),
    )
    phase_names = PHASE_NAMES
    barrier_phase = PHASE_BARRIER
    MAX_TOPK = 32  # top-k ids per token the kernels take (csrc/elastic: kMaxTopk)
    # Measured per SM (NOTES, fifth pass): the pulls and sums read ~16 GB/s, the in-place push writes ~13.5.
    sm_read_gbytes_per_s = 16.0
    sm_write_gbytes_per_s = 13.5

    @classmethod
    def check_build_arguments(cls, group=None, *, max_topk: Optional[int] = None, in_place_dispatch: bool = False,
                              **kwargs) -> None:
        super().check_build_arguments(group, max_topk=max_topk, in_place_dispatch=in_place_dispatch, **kwargs)
        if max_topk is not None and not (is_int(max_topk) and 1 <= max_topk <= cls.MAX_TOPK):
            raise ValueError(f"max_topk must be an int in [1, {cls.MAX_TOPK}], got {max_topk!r}")
        if not isinstance(in_place_dispatch, bool):
            raise TypeError(f"in_place_dispatch must be a bool, got {in_place_dispatch!r}")

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None, topology=None,
                 max_topk: Optional[int] = None, in_place_dispatch: bool = False) -> None:
        """Args as every backend, plus ``max_topk``: the widest top-k any dispatch will use (default and
        maximum 32; smaller saves buffer memory), and ``in_place_dispatch``: room in the buffer for
        ``dispatch(..., in_place=True)`` (R * max_tokens_per_rank rows of 2H bytes more). Both equal on
        every rank, like ``max_tokens_per_rank``."""
        # Set before the base constructor: the construction check there includes them (their values were
        # checked in __new__: check_build_arguments).
        self.max_topk = self.MAX_TOPK if max_topk is None else max_topk
        self.in_place_dispatch = in_place_dispatch
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device,
                         topology=topology)
        self.regions = self._C.elastic.Regions(num_ranks=self.num_ranks, max_tokens=self.config.max_tokens_per_rank,
                                               hidden=hidden_size, num_local_experts=self.num_local_experts,
                                               max_blocks=self.num_blocks, max_topk=self.max_topk,
                                               in_place_dispatch=in_place_dispatch)
        self._open_buffer(self.regions.total_bytes, self.regions.count_words)
        self._in_place_rows: tuple = ()  # weak references to the last in-place dispatch's rows (and scales)

    @classmethod
    def in_place_options(cls, *, num_ranks: int, max_tokens_per_rank: int, num_experts: int, topk: int,
                         pad_multiple: int = 1) -> dict:
        """Constructor options for ``dispatch(..., in_place=True)`` (the combine input is always there)."""
        return {"in_place_dispatch": True}

    def _construction_facts(self) -> dict:
        # Both size the buffer's regions, whose offsets must be equal on every rank.
        return {**super()._construction_facts(), "max_topk": self.max_topk, "in_place_dispatch": self.in_place_dispatch}

    @classmethod
    def wire_bytes(cls, routing_maps, num_ranks, *, row_bytes, hidden, topk, with_probs, expand=False, **options):
        """Each token goes once per remote rank holding any of its experts (pulled), with its index and k
        local ids pushed (plus k weights with probs, k row offsets when expanded); combine returns one
        bf16 row per packet, plus k fp32 values when probs come back. Output rows: one per packet
        (compact) or per (token, local expert) (expanded). See ``Backend.wire_bytes``."""
        packets, rows = route_counts(routing_maps, num_ranks)
        dispatch_unit = row_bytes + 4 + 4 * topk * (1 + int(with_probs) + int(expand))
        return cls._wire_totals(rows if expand else packets, packets, dispatch_unit,
                                2 * hidden + (4 * topk if with_probs else 0))

    # ---- public entry points ------------------------------------------------------------------

    def dispatch(self, hidden, *, routing_map=None, probs=None, topk_idx=None, topk_weights=None,
                 pad_multiple: Optional[int] = None, expand: bool = False, zero_padding: bool = False,
                 handle: Optional[Handle] = None, expert_alignment: Optional[int] = None,
                 in_place: bool = False, **options) -> DispatchOutput:
        """See the module docstring. ``expert_alignment`` is DeepEP's name for ``pad_multiple``.

        Args:
            hidden: [T, H] bf16, or (data [T, H] float8_e4m3fn, scales [T, H/128] float32).
            topk_idx / topk_weights: [T, k] int64 (-1 = none) / [T, k] float32 or None; k <= max_topk.
            pad_multiple: each expert's segment (expanded form) and tokens_per_expert are padded to this.
            expand: deliver expert-grouped rows instead of compact rows.
            zero_padding: zero the padding rows of the expanded form.
            in_place: compact rows written by the sources into this backend's buffer (views of it, valid
                until the next in-place dispatch); needs ``in_place_dispatch=True`` at construction.
            handle: a previous dispatch's handle: send ``hidden`` along its layout (cached dispatch; no
                routing arguments, same T).
            options: none of its own; taken to name what else a caller passed (DeepEP's stream options: a
                TypeError saying what to do instead, not Python's bare unexpected keyword).
        Returns: DispatchOutput (see ``ep_plugin.DispatchOutput``).
        """
        pad_multiple = merge_alignment(pad_multiple, expert_alignment)
        if handle is not None:  # the checks of Backend.dispatch that apply to it, then its own
            self.refuse_if_destroyed("dispatch")
            self.check_options("cached dispatch", options, self.capabilities.cached_dispatch_options)
            self.check_not_capturing("cached dispatch")
            self.check_cached_routing(handle, pad_multiple, routing_map, probs, topk_idx, topk_weights)
            self.check_dispatch_flags(expand=expand, zero_padding=zero_padding)
            if in_place:
                raise ValueError("in_place applies to a first dispatch; a cached dispatch returns new tensors")
            self.check_handle(handle)
            self.check_counts_unchanged(handle)
            return self._cached_dispatch(hidden, handle, expand=expand, zero_padding=zero_padding)
        self.check_routing_form(routing_map, topk_idx)
        self.check_dispatch_flags(expand=expand, zero_padding=zero_padding, in_place=in_place)
        if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 and topk_idx.shape[1] > self.max_topk:
            raise ValueError(f"topk_idx has k={topk_idx.shape[1]} columns; this elastic backend was built with "
                             f"max_topk={self.max_topk}")
        return super().dispatch(hidden, probs=probs, topk_idx=topk_idx, topk_weights=topk_weights,
                                pad_multiple=pad_multiple, expand=expand, zero_padding=zero_padding,
                                in_place=in_place, **options)

    def dispatch_form(self, form: str, *, expand: bool = False, in_place: bool = False, **_) -> str:
        return f"{form}+expand" if expand else f"{form}+in_place" if in_place else form

    def check_dispatch_flags(self, *, expand: bool = False, zero_padding: bool = False,
                             in_place: bool = False) -> None:
        if not all(isinstance(flag, bool) for flag in (expand, zero_padding, in_place)):
            raise TypeError(f"expand, zero_padding and in_place must be bools, got {expand!r}, {zero_padding!r} "
                            f"and {in_place!r}")
        if in_place and (expand or not self.in_place_dispatch):
            raise ValueError("in_place needs the compact form (expand=False) and a backend built with "
                             "in_place_dispatch=True")

    def combine(self, rows, handle: Handle, *, row_probs=None, bias=None, **options) -> CombineOutput:
        """Sum each token's rows at its source (see the module docstring).

        Args:
            rows: [num_rows, H] bf16 in the layout of ``handle``'s dispatch.
            row_probs: shaped like the dispatched probs ([R, k] compact, [R] expanded) or None.
            bias: [T, H] bf16 added to the sum (in fp32), or None.
            options: none of its own (as dispatch's).
        Returns: CombineOutput(hidden [T, H] bf16, probs [T, k] float32 or None).
        """
        self.check_options("combine", options, self.capabilities.combine_options)
        if bias is not None:
            self.check_handle(handle)
            check_tensor("bias", bias, dtypes=(torch.bfloat16,), shape=(handle.num_tokens, self.hidden_size),
                         device=self.device)
            bias = self._aligned(bias)
        return super().combine(rows, handle, row_probs=row_probs, bias=bias)

    # ---- stages ---------------------------------------------------------------------------------

    def _fingerprint(self, op: str, *, dtype, probs: bool = False, topk: int = 0, expand: bool = False,
                     in_place: bool = False, handle: Optional[Handle] = None) -> int:
        """The op's packed fingerprint (``agreement.fingerprint_code``), as the handshake takes it."""
        form = None if op != OP_DISPATCH else self.dispatch_form(TOPK, expand=expand, in_place=in_place)
        return fingerprint_code(op, dtype, probs, form, topk, handle.handle_id if handle is not None else 0,
                                self.op_records_backward, self.op_probs_need_grad)

    def _capacity(self, topk: int, expand: bool, pad_multiple: int) -> int:
        """Rows of a non-blocking output: the most any rank can receive."""
        R, T, L = self.num_ranks, self.config.max_tokens_per_rank, self.num_local_experts
        if not expand:
            return R * T
        rows = R * T * min(topk, L) + (pad_multiple - 1) * L
        return -(-rows // pad_multiple) * pad_multiple

    def _dispatch_fields(self, routing: Routing, expand: bool) -> list[tuple]:
        """The scratch pieces of a dispatch: the layout's and the count exchange's."""
        R, L = self.num_ranks, self.num_local_experts
        fields = self.layout_fields(routing, None, R) + [
            ("tokens_per_expert", (L,), torch.int64), ("real_per_expert", (L,), torch.int64),
            ("total_rows", (1,), torch.int64), ("total_packets", (1,), torch.int64),
            ("row_base", (R, L), torch.int32), ("expert_start", (L,), torch.int32), ("num_packets", (R,), torch.int32)]
        if not expand:
            fields.append(("dest_base", (R,), torch.int32))
        return fields

    @op_range("dispatch")
    def _dispatch(self, hidden, routing: Routing, probs, pad_multiple, *, expand: bool = False,
                  zero_padding: bool = False, in_place: bool = False) -> DispatchOutput:
        assert routing.form != ROUTING_MAP  # dispatch() rejects the routing map
        self.buffer.raise_if_failed()
        hidden, routing, probs, refused = self._within_budget(hidden, routing, probs)  # every rank refuses
        fp8 = isinstance(hidden, (tuple, list))
        data, scales = (hidden[0], hidden[1]) if fp8 else (hidden, None)
        data = self._aligned(data)
        T, H, R, L = routing.num_tokens, self.hidden_size, self.num_ranks, self.num_local_experts
        k = routing.topk_idx.shape[1]
        dev = self.device
        scratch = self._scratch(("dispatch", T, k, expand), lambda: self._dispatch_fields(routing, expand))
        at = scratch.address
        fingerprint = self._fingerprint(OP_DISPATCH, dtype=data.dtype, probs=probs is not None, topk=k,
                                        expand=expand, in_place=in_place)
        packet_capacity = R * self.config.max_tokens_per_rank
        worst_case = self._capacity(k, expand, pad_multiple)
        # What can be allocated before the first launch is (an allocation that fails then leaves the peers
        # untouched, and the ranks in step): in place the receive's metadata (worst-case size in both modes),
        # non-blocking every output (its capacity is the worst case).
        placed = self._in_place_metadata(worst_case, k, probs is not None) if in_place else None
        outputs = None if self.config.blocking or in_place else self._receive_outputs(
            worst_case, packet_capacity, k, expand, data.dtype, fp8, probs is not None)
        self._layout_and_exchange(routing, None, scratch, PHASE_DISPATCH, fingerprint, pad_multiple=pad_multiple,
                                  refused=refused,
                                  addresses=lambda: dict(row_base=at("row_base"), expert_start=at("expert_start"),
                                                         tokens_per_expert=at("tokens_per_expert"),
                                                         real_per_expert=at("real_per_expert"),
                                                         num_packets=at("num_packets"), total_rows=at("total_rows"),
                                                         total_packets=at("total_packets")))
        counted = self._mark() if self.config.blocking else None
        # What needs no host count is enqueued before the blocking mode's count read, and runs
        # meanwhile: the send, and in place (rows in the buffer, metadata at worst-case size) the receive.
        row_bytes = H if fp8 else 2 * H
        scale_bytes = H // self.FP8_BLOCK * 4 if fp8 else 0
        self._keep_on_stream(data, scales, routing.topk_idx, probs)
        send = self._C.elastic.SendArgs(hidden=data, row_bytes=row_bytes, scales=scales, scale_bytes=scale_bytes,
                                        send_slot=at("send_slot"), topk_idx=routing.topk_idx, topk_weights=probs,
                                        k_index=at("k_index") if expand else None,
                                        dest_base=None if expand else at("dest_base"),
                                        push_payload=in_place, topk=k, num_tokens=T, bulk_copy=self._bulk)
        self._C.elastic.dispatch_send(self.buffer.raw, self.regions, send, self.num_blocks, self._stream())
        if in_place:
            self._writing_over_in_place_rows()
        receive = dict(row_bytes=row_bytes, scale_bytes=scale_bytes, num_packets=at("num_packets"), topk=k,
                       expand=expand, row_base=at("row_base"), expert_start=at("expert_start"),
                       tokens_per_expert=at("tokens_per_expert"), real_per_expert=at("real_per_expert"),
                       zero_padding=zero_padding)
        if in_place:
            out_idx, out_weights = placed
            self._receive_in_place(worst_case, out_idx, out_weights, receive)
        tokens_list = None
        if self.config.blocking:
            with nvtx_range("ep.elastic.dispatch.wait_count"):
                words = self._dispatch_counts(counted, routing, refused)
                packet_capacity = words[self._C.MAILBOX_TOTAL_PACKETS]
                capacity = words[self._C.MAILBOX_TOTAL_ROWS] if expand else packet_capacity
                tokens_list = words[self._C.MAILBOX_EXPERT_ROWS:]
        else:
            capacity = worst_case
        packet_rows = None
        if in_place:  # the sources wrote the rows into this rank's buffer: hand out views of it
            out = self._buffer_rows(self.regions.off_recv_rows, capacity, H, data.dtype)
            out_scales = (self._buffer_rows(self.regions.off_recv_scales, capacity, H // self.FP8_BLOCK,
                                            torch.float32) if fp8 else None)
            out_idx = out_idx[:capacity]
            out_weights = out_weights[:capacity] if out_weights is not None else None
            self._in_place_rows = tuple(weakref.ref(t) for t in (out, out_scales) if t is not None)
        else:
            out, out_scales, out_idx, out_weights, packet_rows = outputs or self._receive_outputs(
                capacity, packet_capacity, k, expand, data.dtype, fp8, probs is not None)
            args = self._C.elastic.ReceiveArgs(
                out=out, out_scales=out_scales, capacity=capacity, out_topk_idx=out_idx,
                out_topk_weights=None if expand else out_weights, out_row_weights=out_weights if expand else None,
                packet_rows=packet_rows, bulk_copy=self._bulk, **receive)
            self._C.elastic.dispatch_receive(self.buffer.raw, self.regions, args, self.num_blocks,
                                             self._stream())
        # Views only of what is handed out: the handle's counts, the flags, the valid-row counts.
        tokens_per_expert, real_per_expert, total_rows, total_packets = scratch.tensors(HANDED_OUT_COUNTS)
        input_flags = scratch.tensor("input_flags")
        layout = ElasticLayout(scratch=scratch, topk_idx=routing.topk_idx, total_packets=total_packets,
                               total_rows=total_rows, packet_rows=packet_rows,
                               input_flags=input_flags, topk=k, expand=expand, zero_padding=zero_padding,
                               capacity=capacity)
        handle = Handle(
            backend=self, num_tokens=T, hidden_size=H, hidden_dtype=torch.bfloat16,
            probs_shape=routing.probs_shape if probs is not None else None, num_experts=self.num_experts,
            num_local_experts=L, pad_multiple=pad_multiple, num_rows=capacity, tokens_per_expert=tokens_per_expert,
            num_real_tokens_per_expert=real_per_expert, layout=layout,
            handle_id=self._next_handle_id(),
            output_form=EXPERT_ROWS if expand else COMPACT, row_probs_shape=(capacity,) if expand else (capacity, k))
        rows = (out, out_scales) if fp8 else out
        valid_rows = None if self.config.blocking else layout.total_rows if expand else layout.total_packets
        return DispatchOutput(rows, out_weights, tokens_per_expert, handle, topk_idx=out_idx,
                              num_valid_rows=valid_rows, tokens_per_expert_list=tokens_list,
                              ready=streams.record_ready(dev))

    def destroy(self) -> None:
        """Free the buffer, bumping the version of the last in-place dispatch's rows first: a backward that saved
        them raises (modified by an inplace operation) instead of reading freed memory."""
        self._writing_over_in_place_rows()
        self._in_place_rows = ()
        super().destroy()

    def _writing_over_in_place_rows(self) -> None:
        """The send just enqueued writes over the rows the last in-place dispatch handed out: bump their
        version counter (shared by every view of the region), as an in-place op would, so that a backward
        that saved them (an expert's input, kept for its weight gradient) raises instead of computing
        with the new rows."""
        for ref in self._in_place_rows:
            rows = ref()
            if rows is not None and not rows.is_inference():  # inference tensors keep no version
                torch.autograd.graph.increment_version(rows)

    def _receive_outputs(self, capacity: int, packet_capacity: int, k: int, expand: bool, dtype: torch.dtype,
                         fp8: bool, with_weights: bool) -> tuple:
        """A copying dispatch's outputs, uninitialized: (rows [capacity, H], fp8 scales or None, top-k ids
        [capacity, k] (compact) or None, weights ([capacity, k] compact, [capacity] expanded) or None, and
        the expanded form's packet rows [packet_capacity, k] (kept with the handle) or None)."""
        H = self.hidden_size
        out = self._empty(capacity, H, dtype=dtype)
        out_scales = self._empty(capacity, H // self.FP8_BLOCK, dtype=torch.float32) if fp8 else None
        if expand:
            out_weights = self._empty(capacity, dtype=torch.float32) if with_weights else None
            packet_rows = torch.empty(packet_capacity, k, dtype=torch.int32, device=self.device)
            return out, out_scales, None, out_weights, packet_rows
        out_weights = self._empty(capacity, k, dtype=torch.float32) if with_weights else None
        return out, out_scales, self._empty(capacity, k, dtype=torch.int64), out_weights, None

    def _in_place_metadata(self, rows: int, k: int, with_weights: bool) -> tuple:
        """An in-place dispatch's (top-k ids [rows, k] int64, weights [rows, k] or None), uninitialized."""
        return (self._empty(rows, k, dtype=torch.int64),
                self._empty(rows, k, dtype=torch.float32) if with_weights else None)

    def _receive_in_place(self, rows: int, out_idx: torch.Tensor, out_weights: Optional[torch.Tensor],
                          receive: dict) -> None:
        """Launch the receive of an in-place dispatch: the payload is in the buffer already, so it only
        places the compact rows' top-k ids (and weights) into ``out_idx`` / ``out_weights``, of ``rows``
        rows (the worst case: it runs before the blocking mode's count read)."""
        args = self._C.elastic.ReceiveArgs(out=self.buffer.raw.region_address + self.regions.off_recv_rows,
                                           capacity=rows, out_topk_idx=out_idx, out_topk_weights=out_weights,
                                           payload_pushed=True, bulk_copy=self._bulk, **receive)
        self._C.elastic.dispatch_receive(self.buffer.raw, self.regions, args, self.num_blocks, self._stream())

    def experts_per_token_limit(self) -> int:
        return self.max_topk

    @staticmethod
    def check_cached_form(handle: Handle, *, expand: bool = False, zero_padding: bool = False) -> None:
        """ValueError when a cached dispatch asks for another form than its handle's (expand=True on a compact
        one); also asked by the hierarchical backend, before its rails move anything. ``zero_padding`` is per
        call, as DeepEP V2's: an expanded handle's padding is zeroed when either dispatch asked for it."""
        layout: ElasticLayout = handle.layout
        if expand and not layout.expand:
            raise ValueError(f"a cached dispatch delivers its handle's form (expand={layout.expand}); got "
                             f"expand={expand}")

    @op_range("cached_dispatch")
    def _cached_dispatch(self, hidden, handle: Handle, *, expand: bool = False,
                         zero_padding: bool = False) -> DispatchOutput:
        """Send new rows along a previous dispatch's layout: no layout, no count exchange. ``expand``: what the
        caller passed (the form is the handle's: expand=True on a compact one is refused); ``zero_padding``
        zeroes an expanded output's padding this time (also when the handle's dispatch did not)."""
        data = self.check_cached_input(hidden, handle)
        fp8 = isinstance(hidden, (tuple, list))
        layout: ElasticLayout = handle.layout
        self.check_cached_form(handle, expand=expand, zero_padding=zero_padding)
        self.buffer.raise_if_failed()
        at = layout.scratch.address
        scales = hidden[1] if fp8 else None
        data = self._aligned(data)
        H = self.hidden_size
        # The outputs before the first launch: an allocation that fails then leaves the ranks in step.
        out = self._empty(layout.capacity, H, dtype=data.dtype)
        out_scales = self._empty(layout.capacity, H // self.FP8_BLOCK, dtype=torch.float32) if fp8 else None
        self._exchange(PHASE_CACHED, self._fingerprint(OP_DISPATCH_AGAIN, dtype=data.dtype, handle=handle))
        row_bytes = H if fp8 else 2 * H
        scale_bytes = H // self.FP8_BLOCK * 4 if fp8 else 0
        # The handle may go before this op has run: what it reads of the layout is tied to this stream too.
        self._keep_on_stream(data, scales)
        self._keep_layout_on_stream(layout.scratch.memory, layout.packet_rows)
        send = self._C.elastic.SendArgs(hidden=data, row_bytes=row_bytes, scales=scales, scale_bytes=scale_bytes,
                                        send_slot=at("send_slot"), num_tokens=handle.num_tokens,
                                        bulk_copy=self._bulk)
        self._C.elastic.dispatch_send(self.buffer.raw, self.regions, send, self.num_blocks, self._stream())
        receive = self._C.elastic.ReceiveArgs(
            out=out, row_bytes=row_bytes, out_scales=out_scales, scale_bytes=scale_bytes,
            capacity=layout.capacity, num_packets=at("num_packets"), topk=layout.topk, expand=layout.expand,
            cached=True, expert_start=at("expert_start"), tokens_per_expert=at("tokens_per_expert"),
            real_per_expert=at("real_per_expert"), packet_rows=layout.packet_rows,
            zero_padding=layout.zero_padding or zero_padding, bulk_copy=self._bulk)
        self._C.elastic.dispatch_receive(self.buffer.raw, self.regions, receive, self.num_blocks, self._stream())
        valid_rows = None if self.config.blocking else layout.total_rows if layout.expand else layout.total_packets
        rows = (out, out_scales) if fp8 else out
        return DispatchOutput(rows, None, handle.tokens_per_expert, handle, num_valid_rows=valid_rows,
                              ready=streams.record_ready(self.device))

    def _dispatch_again(self, hidden, handle: Handle) -> torch.Tensor:
        # A gradient: the padding rows' is 0 (combine never read them). Left unzeroed, a grouped GEMM run over
        # them (tokens_per_expert counts them) would take whatever the output's memory held into its weights'.
        return self._cached_dispatch(hidden, handle, zero_padding=handle.layout.expand).hidden

    def _buffer_rows(self, offset: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, width] of ``dtype`` over this rank's buffer at ``offset`` (fp8 as bytes, reinterpreted)."""
        if dtype == torch.float8_e4m3fn:
            return self.buffer.region_tensor(offset, (rows, width), torch.uint8).view(dtype)
        return self.buffer.region_tensor(offset, (rows, width), dtype)

    def combine_input(self, handle: Handle) -> torch.Tensor:
        """The combine input of ``handle`` inside this rank's buffer: [rows, H] bf16, compact form only.

        Write the expert output there and pass this tensor to ``combine(rows, handle)``: the source
        ranks then read each row where it is (no copy on the expert side). Valid from the dispatch of
        ``handle`` until its combine; another op on this backend in between may overwrite it, and
        the memory goes with ``destroy()``. Every rank of the combine must pass its own.
        """
        self.refuse_if_destroyed("combine_input")
        self.check_handle(handle)
        layout: ElasticLayout = handle.layout
        if layout.expand:
            raise ValueError("combine_input needs a compact dispatch (expand=False): expanded rows are summed "
                             "per packet on the expert rank before they travel")
        view = self._combine_input_view(layout, self.regions.off_comb_data, layout.capacity)
        self._wait_for_queued_ops()  # the caller writes there next, on its stream
        return view

    def _in_place(self, rows: torch.Tensor, layout: ElasticLayout) -> bool:
        """Whether ``rows`` is the combine input in this rank's buffer (then it is read in place)."""
        return not layout.expand and self._is_combine_input(rows, layout, self.regions.off_comb_data)

    def _refuse_rows_over_comb_data(self, rows: torch.Tensor) -> None:
        """ValueError, before any launch, for rows a copying combine would read from this rank's comb_data (the
        combine input's memory, but not read in place: another place there, or an expanded handle): that
        combine's sends write the same memory meanwhile, and the sums would come out wrong without a word."""
        if rows.numel() == 0:
            return
        start = self.buffer.raw.region_address + self.regions.off_comb_data
        end = start + self.num_ranks * self.regions.max_tokens * self.hidden_size * 2  # bf16 [R][max_tokens][H]
        first = rows.data_ptr()
        last = first + rows.numel() * rows.element_size()  # (combine's rows are contiguous: check_hidden)
        if first < end and start < last:
            raise ValueError(
                "combine: these rows lie in this rank's combine-input memory (combine_input's), but not as the "
                "combine input of this handle (another place there, or an expanded handle), so combine would "
                "copy them while the peers' rows are written there: pass combine_input(handle) itself, or a "
                "tensor of your own")

    @op_range("combine")
    def _combine(self, rows, handle: Handle, row_probs, bias=None) -> CombineOutput:
        self.buffer.raise_if_failed()
        layout: ElasticLayout = handle.layout
        at = layout.scratch.address
        T, k, dev = handle.num_tokens, layout.topk, self.device
        in_place = self._in_place(rows, layout)
        op = OP_COMBINE_IN_PLACE if in_place else OP_COMBINE
        rows_in = None if in_place else self._aligned(rows)  # in place: the buffer is read, not the tensor
        if rows_in is not None:
            self._refuse_rows_over_comb_data(rows_in)
        # The outputs before the first launch: an allocation that fails then leaves the ranks in step.
        out = torch.empty(T, self.hidden_size, dtype=torch.bfloat16, device=dev)
        values = torch.empty(T, k, dtype=torch.float32, device=dev) if row_probs is not None else None
        self._exchange(PHASE_COMBINE, self._fingerprint(op, dtype=rows.dtype, probs=row_probs is not None,
                                                        handle=handle), input_read_in_place=in_place)
        # The handle may go before this op has run: what it reads of the layout is tied to this stream too
        # (packet_rows: the expanded form's send; topk_idx: where values are routed back).
        self._keep_on_stream(rows_in, row_probs, bias)
        self._keep_layout_on_stream(layout.scratch.memory, layout.packet_rows,
                                    layout.topk_idx if row_probs is not None else None)
        # In place, only the routed-back values (if any) travel ahead of the receive.
        send_needed = not in_place or row_probs is not None
        if send_needed:
            send = self._C.elastic.CombineSendArgs(rows=rows_in, slot_values=row_probs,
                                                   num_packets=at("num_packets"),
                                                   packet_rows=layout.packet_rows if layout.expand else None,
                                                   topk=k)
            self._C.elastic.combine_send(self.buffer.raw, self.regions, send, self.num_blocks, self._stream())
        if not in_place:  # the peers' send writes this rank's rows over the combine input handed out last
            self._combine_input_owner = None
        receive = self._C.elastic.CombineRecvArgs(out=out, bias=bias, out_topk_values=values,
                                                  send_slot=at("send_slot"), topk_idx=layout.topk_idx, topk=k,
                                                  num_tokens=T, dest_base=at("dest_base") if in_place else None,
                                                  wait_for_send=send_needed)
        self._C.elastic.combine_recv(self.buffer.raw, self.regions, receive, self.num_blocks, self._stream())
        return CombineOutput(out, values)
