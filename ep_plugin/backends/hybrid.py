"""``hybrid``: compiled dispatch/combine within one NVLink domain (Megatron ``hybridep`` semantics).

Stages (each a kernel in ``csrc/``, run on the caller's current stream; NVTX range per stage):

1. layout (``csrc/layout.cu``, one kernel, no host sync): from routing_map or topk_idx, each token's send
   slot at every destination rank (``send_slot [T, R]``: tokens sent to a rank are numbered in
   token order, -1 = none), its index within each chosen expert (``k_index [T, E]``), and the
   counts per expert and per destination rank.
2. notify (``csrc/notify.cu``): advance the device-resident op number, push the counts into every
   peer's buffer, handshake; derive this rank's receive layout (segment starts, row bases per
   (source, expert), padded ``tokens_per_expert``, total rows).
3. dispatch_send (``csrc/dispatch.cu``): each token goes once per destination rank with its
   per-local-expert k index and prob.
4. permute (``csrc/permute.cu``): each packet expands into its expert rows; padding zeroed.
   (A later backend can stop after stage 3 and read the per-source packets directly.)
5. combine (``csrc/combine.cu``): the expert side sums a packet's rows (fp32, rounded once to bf16)
   and sends one row per (token, source rank) back; the source sums those in fp32.

Row order of the dispatch output is the reference contract (local expert, source rank, source
token), bitwise equal to ``reference``. Combine tolerance: each expert rank's partial sum is
rounded to bf16 before the source adds the partials, so a token whose experts live on several
ranks can differ from the reference (which rounds once) by about one bf16 ulp per rank of the
result's magnitude (|err| <= R * 2**-8 * max|partial|); a token whose experts are all on one rank
matches exactly.

Blocking mode (``config.blocking``): the output has exactly the received rows; the host reads the
total from pinned memory owned by the buffer after waiting (with a timeout) on an event recorded
after the notify kernel. Non-blocking mode: the output has ``num_permuted_tokens`` rows (0 = the
worst case), counts stay on the device, rows past the budget are dropped and raise
``handle.layout.overflow`` (also ``backend.over_budget``); nothing syncs, so dispatch and combine
can be captured in a CUDA graph (the op number advances on the device at each replay).

Valid output in non-blocking mode: rows ``[0, min(sum(tokens_per_expert), budget))`` (padding rows
inside a segment are zero); rows past that are left unwritten. ``tokens_per_expert`` is not
clipped: when ``overflow`` is set the segments that did not fit were dropped.

Timeouts: every device wait gives up after ``config.timeout_s``, writes rank / phase / peer /
counters to mapped host memory and exits (no trap, so the process stays usable); the host raises
``EPTimeoutError`` with that report at its next sync point (blocking dispatch) or the next call.
After a timeout the backend is unusable (its op numbers no longer agree with its peers'):
build a new one. ``check_errors()`` syncs and raises what is pending.

Rules and limits:
- Every op (dispatch, combine, dispatch_again) starts with a handshake of all ranks, so all
  ranks must issue the same ops in the same order, one op in flight per backend (one stream).
- FP8: ``backend.dispatch((data [T, H] float8_e4m3fn, scales [T, H/128] float32), ...)`` returns
  ``hidden`` as ``(rows [R, H] fp8, row_scales [R, H/128])``; padding rows have zero data and
  scales. FP8 goes through ``backend.dispatch`` only (not the autograd ``ep_plugin.dispatch``);
  combine and dispatch_again of its handle are bf16.
- Buffer per rank: about ``R * max_tokens_per_rank * (4 * H + 12 * L)`` bytes (dispatch packets,
  their k/prob metadata, combine rows); up to 32 ranks and 256 local experts; H % 8 == 0.
- Co-residency: (ranks sharing a GPU) x num_sms must not exceed the GPU's SMs
  (``max_sms_per_gpu`` overrides the detected count); the constructor refuses otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _cuda
from ..errors import BackendUnavailableError
from ..handle import CombineOutput, DispatchOutput, Handle
from ..routing import ROUTING_MAP, Routing
from ..transport.ipc import IpcBuffer, ranks_per_gpu
from .base import Backend, Capabilities

try:  # the `nvtx` package when installed, else torch's bindings
    import nvtx as _nvtx

    def nvtx_range(name: str):
        return _nvtx.annotate(name, domain="ep_plugin")
except ImportError:  # pragma: no cover - depends on the environment

    def nvtx_range(name: str):
        return torch.cuda.nvtx.range(name)


PHASE_NAMES = {
    1: "dispatch/notify (handshake + count exchange)",
    2: "combine/handshake",
    3: "dispatch_again/handshake (backward of combine)",
    4: "dispatch/receive (waiting for tokens)",
    5: "combine/receive (waiting for expert rows)",
}
PHASE_DISPATCH, PHASE_COMBINE, PHASE_DISPATCH_AGAIN = 1, 2, 3


@dataclass(eq=False)
class HybridLayout:
    """Device tensors of one dispatch; combine and both backwards read them (owned by the Handle)."""

    send_slot: torch.Tensor  # [T, R] int32: packet slot at each rank, -1 = not sent
    k_index: torch.Tensor  # [T, E] int32: index of the token within (this rank, expert), -1 = not routed
    topk_idx: Optional[torch.Tensor]  # [T, k] int64 of a top-k dispatch (to shape the probs gradient)
    row_base: torch.Tensor  # [R, L] int32: first output row of (source rank, local expert)
    expert_start: torch.Tensor  # [L] int32
    num_packets: torch.Tensor  # [R] int32: packets received from each source
    total_rows: torch.Tensor  # [1] int64: sum of padded segment lengths
    packet_rows: torch.Tensor  # [R * max_tokens, L] int32: output row of each received (packet, expert)
    overflow: torch.Tensor  # [1] int32: 1 when rows fell past the budget (non-blocking)
    bad_expert_ids: Optional[torch.Tensor]  # [] bool: top-k ids out of range were dropped (non-blocking)
    budget: int  # rows of the dispatch output
    fp8: bool


class HybridBackend(Backend):
    """CUDA dispatch/combine over IPC buffers; ranks may share a GPU (several processes) or not."""

    name = "hybrid"
    capabilities = Capabilities(
        devices=("cuda",),
        hidden_dtypes=(torch.bfloat16,),
        probs_dtypes=(torch.float32,),
        fp8_dispatch=True,
        non_blocking=True,
        cuda_graphs=True,
    )

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None) -> None:
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device)
        if not _cuda.available():
            raise BackendUnavailableError(f"backend 'hybrid' needs the CUDA extension and a GPU: {_cuda.describe()}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.num_ranks > 32:
            raise ValueError(f"backend 'hybrid' supports at most 32 ranks per NVLink domain, got {self.num_ranks}")
        if self.num_local_experts > 256:
            raise ValueError(f"backend 'hybrid' supports at most 256 local experts, got {self.num_local_experts}")
        if hidden_size % 8:
            raise ValueError(f"backend 'hybrid' needs hidden_size divisible by 8 (16-byte rows), got {hidden_size}")
        self.num_blocks = self.config.num_sms
        self._check_co_residency()
        self.buffer = IpcBuffer(self.group, device=self.device, max_tokens=self.config.max_tokens_per_rank,
                                hidden_size=hidden_size, num_local_experts=self.num_local_experts,
                                max_blocks=self.num_blocks, timeout_s=self.config.timeout_s, phase_names=PHASE_NAMES)
        self._C = _cuda.extension()
        self._bulk = int(self.config.bulk_copy)  # the kernels fall back to register copies below sm_90
        self.over_budget: Optional[torch.Tensor] = None  # overflow flag of the latest dispatch
        # Non-blocking top-k dispatch: ids out of range were dropped, not indexed (device bool).
        self.invalid_expert_ids: Optional[torch.Tensor] = None

    def _check_co_residency(self) -> None:
        """Refuse (before any launch) grids that could not all be resident at once (DESIGN §6)."""
        sharing = ranks_per_gpu(self.group, self.device)
        sms = self.config.max_sms_per_gpu or torch.cuda.get_device_properties(self.device).multi_processor_count
        if sharing * self.num_blocks > sms:
            raise ValueError(
                f"backend 'hybrid': {sharing} ranks share one GPU and each runs {self.num_blocks} spin-waiting "
                f"blocks (num_sms), {sharing * self.num_blocks} in all, but the GPU offers {sms} SMs; all must be "
                f"resident at once or the kernels deadlock. Lower EP_PLUGIN_NUM_SMS to <= {sms // sharing}.")

    # ---- stages -------------------------------------------------------------------------

    def _layout(self, routing: Routing, probs: Optional[torch.Tensor]):
        """Send-side layout: one kernel (``csrc/layout.cu``) on the current stream, no host sync.

        Args:
            routing: ``routing_map`` [T, E] bool or ``topk_idx`` [T, K] int64 (-1 = none), contiguous on
                this device (``make_routing`` checked dtype, shape and contiguity).
            probs: [T, E] float32 (routing map: returned as is), [T, K] float32 (top-k), or None.
        Returns: (send_slot [T, R] int32 (-1 = not sent), k_index [T, E] int32 (-1 = not routed),
            expert_counts [E] int32, rank_counts [R] int32, dense_probs [T, E] float32 or None,
            bad_ids [] bool or None). bad_ids (non-blocking top-k only): some id was < -1 or >= E; such
            ids were dropped, never indexed. A token naming an expert twice (possible only without the
            blocking mode's host checks) chose it once, with the prob of its last such slot.
        """
        T, E, R, L = routing.num_tokens, self.num_experts, self.num_ranks, self.num_local_experts
        dev = self.device
        send_slot = torch.empty(T, R, dtype=torch.int32, device=dev)
        k_index = torch.empty(T, E, dtype=torch.int32, device=dev)
        expert_counts = torch.empty(E, dtype=torch.int32, device=dev)
        rank_counts = torch.empty(R, dtype=torch.int32, device=dev)
        routing_map = topk_idx = probs_in = dense_out = bad_out = topk = 0  # pointer 0 = absent
        dense_probs = bad_ids = None
        if routing.form == ROUTING_MAP:
            routing_map, dense_probs = routing.routing_map.data_ptr(), probs  # probs are dense already
        else:
            topk_idx, topk = routing.topk_idx.data_ptr(), routing.topk_idx.shape[1]
            if probs is not None:
                dense_probs = torch.empty(T, E, dtype=torch.float32, device=dev)
                probs_in, dense_out = probs.data_ptr(), dense_probs.data_ptr()
            if not self.config.blocking:  # never index with a bad id; report it instead
                bad_ids = torch.empty((), dtype=torch.bool, device=dev)
                bad_out = bad_ids.data_ptr()
        self._C.layout(routing_map, topk_idx, probs_in, T, R, L, topk, send_slot.data_ptr(), k_index.data_ptr(),
                       expert_counts.data_ptr(), rank_counts.data_ptr(), dense_out, bad_out, dev.index,
                       self._stream(), max_blocks=self.num_blocks)
        return send_slot, k_index, expert_counts, rank_counts, dense_probs, bad_ids

    def _layout_torch(self, routing: Routing, probs: Optional[torch.Tensor]):
        """``_layout`` with torch ops (about 15 kernels): the oracle of ``tests/test_layout_gpu.py``.

        Same arguments and results, except that a token naming an expert twice gets a dense prob
        from ``scatter_`` (unspecified which duplicate).
        """
        T, E, R, L = routing.num_tokens, self.num_experts, self.num_ranks, self.num_local_experts
        bad_ids = None
        if routing.form == ROUTING_MAP:
            mask = routing.routing_map
            dense_probs = probs
        else:
            idx = routing.topk_idx
            in_range = (idx >= 0) & (idx < E)
            if not self.config.blocking:  # never index with a bad id; report it instead
                bad_ids = ((idx < -1) | (idx >= E)).any()
            column = torch.where(in_range, idx, torch.full_like(idx, E))  # column E collects "none"
            mask = torch.zeros(T, E + 1, dtype=torch.bool, device=self.device).scatter_(1, column, True)[:, :E]
            mask = mask.contiguous()
            dense_probs = None
            if probs is not None:
                dense_probs = torch.zeros(T, E + 1, dtype=torch.float32, device=self.device)
                dense_probs.scatter_(1, column, probs)
                dense_probs = dense_probs[:, :E].contiguous()
        chosen = mask.to(torch.int32)
        k_index = torch.cumsum(chosen, 0, dtype=torch.int32) - chosen
        k_index.masked_fill_(~mask, -1)
        expert_counts = chosen.sum(0, dtype=torch.int32)
        to_rank = mask.reshape(T, R, L).any(2)
        sent = to_rank.to(torch.int32)
        send_slot = torch.cumsum(sent, 0, dtype=torch.int32) - sent
        send_slot.masked_fill_(~to_rank, -1)
        rank_counts = sent.sum(0, dtype=torch.int32)
        return send_slot, k_index, expert_counts, rank_counts, dense_probs, bad_ids

    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a dispatch output (tests replace this to surround outputs with canaries)."""
        return torch.empty(*shape, dtype=dtype, device=self.device)

    @staticmethod
    def _aligned(tensor: torch.Tensor) -> torch.Tensor:
        """Rows are moved in 16-byte words (and bulk copies need 16-byte addresses): copy a view
        that starts mid-word (rare: an odd storage offset) into fresh storage."""
        return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _keep_on_stream(self, *tensors) -> None:
        """Tie caller-owned inputs to the stream our kernels read them on (DESIGN §3.2)."""
        if self.config.avoid_record_stream or torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(self.device)
        for tensor in tensors:
            if tensor is not None and tensor.numel():
                tensor.record_stream(stream)

    def _notify(self, phase: int, **counts) -> None:
        if counts:
            self._C.notify(self.buffer.raw, phase, counts["expert_counts"].data_ptr(), counts["rank_counts"].data_ptr(),
                           counts["pad_multiple"], counts["row_base"].data_ptr(), counts["expert_start"].data_ptr(),
                           counts["tokens_per_expert"].data_ptr(), counts["real_per_expert"].data_ptr(),
                           counts["num_packets"].data_ptr(), counts["total_rows"].data_ptr(), self._stream())
        else:
            self._C.notify(self.buffer.raw, phase, 0, 0, 1, 0, 0, 0, 0, 0, 0, self._stream())

    def _worst_case_rows(self, routing: Routing, pad_multiple: int) -> int:
        per_token = self.num_local_experts if routing.form == ROUTING_MAP else min(
            routing.topk_idx.shape[1], self.num_local_experts)
        return (self.num_ranks * self.config.max_tokens_per_rank * per_token
                + self.num_local_experts * (pad_multiple - 1))

    # ---- Backend protocol ---------------------------------------------------------------

    def _dispatch(self, hidden, routing: Routing, probs, pad_multiple) -> DispatchOutput:
        self.buffer.raise_if_timed_out()
        fp8 = isinstance(hidden, (tuple, list))
        data, scales = (hidden[0], hidden[1]) if fp8 else (hidden, None)
        data = self._aligned(data)
        T, H, R, L = routing.num_tokens, self.hidden_size, self.num_ranks, self.num_local_experts
        dev = self.device
        with nvtx_range("ep.hybrid.dispatch.layout"):
            send_slot, k_index, expert_counts, rank_counts, dense_probs, bad_ids = self._layout(routing, probs)
            row_base = torch.empty(R, L, dtype=torch.int32, device=dev)
            expert_start = torch.empty(L, dtype=torch.int32, device=dev)
            tokens_per_expert = torch.empty(L, dtype=torch.int64, device=dev)
            real_per_expert = torch.empty(L, dtype=torch.int64, device=dev)
            num_packets = torch.empty(R, dtype=torch.int32, device=dev)
            total_rows = torch.empty(1, dtype=torch.int64, device=dev)
        with nvtx_range("ep.hybrid.dispatch.notify"):
            self._notify(PHASE_DISPATCH, expert_counts=expert_counts, rank_counts=rank_counts,
                         pad_multiple=pad_multiple, row_base=row_base, expert_start=expert_start,
                         tokens_per_expert=tokens_per_expert, real_per_expert=real_per_expert,
                         num_packets=num_packets, total_rows=total_rows)
        if self.config.blocking:
            with nvtx_range("ep.hybrid.dispatch.wait_count"):
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dev))
                self.buffer.wait_event(event, self.config.timeout_s + 5.0, "the dispatch counts")
                budget = self.buffer.host_total_rows()
        else:
            budget = self.config.num_permuted_tokens or self._worst_case_rows(routing, pad_multiple)

        with nvtx_range("ep.hybrid.dispatch.send"):
            row_bytes = H if fp8 else 2 * H
            scale_bytes = H // self.FP8_BLOCK * 4 if fp8 else 0
            self._keep_on_stream(data, scales, dense_probs)
            self._C.dispatch_send(self.buffer.raw, data.data_ptr(), row_bytes, scales.data_ptr() if fp8 else 0,
                                  scale_bytes, send_slot.data_ptr(), k_index.data_ptr(),
                                  dense_probs.data_ptr() if dense_probs is not None else 0, T, self._bulk,
                                  self.num_blocks, self._stream())
        with nvtx_range("ep.hybrid.dispatch.permute"):
            out = self._empty(budget, H, dtype=data.dtype)
            out_scales = self._empty(budget, H // self.FP8_BLOCK, dtype=torch.float32) if fp8 else None
            out_probs = self._empty(budget, dtype=torch.float32) if probs is not None else None
            packet_rows = torch.empty(R * self.config.max_tokens_per_rank, L, dtype=torch.int32, device=dev)
            overflow = torch.zeros(1, dtype=torch.int32, device=dev)
            self._C.permute(self.buffer.raw, out.data_ptr(), row_bytes, out_scales.data_ptr() if fp8 else 0,
                            scale_bytes, out_probs.data_ptr() if out_probs is not None else 0, budget,
                            row_base.data_ptr(), expert_start.data_ptr(), tokens_per_expert.data_ptr(),
                            real_per_expert.data_ptr(), num_packets.data_ptr(), total_rows.data_ptr(),
                            packet_rows.data_ptr(), 0, overflow.data_ptr(), self._bulk, self.num_blocks,
                            self._stream())
        layout = HybridLayout(send_slot=send_slot, k_index=k_index,
                              topk_idx=routing.topk_idx if routing.form != ROUTING_MAP else None, row_base=row_base,
                              expert_start=expert_start, num_packets=num_packets, total_rows=total_rows,
                              packet_rows=packet_rows, overflow=overflow, bad_expert_ids=bad_ids, budget=budget,
                              fp8=fp8)
        handle = Handle(
            backend=self, num_tokens=T, hidden_size=H, hidden_dtype=torch.bfloat16,
            probs_shape=routing.probs_shape if probs is not None else None, num_experts=self.num_experts,
            num_local_experts=L, pad_multiple=pad_multiple, num_rows=budget, tokens_per_expert=tokens_per_expert,
            num_real_tokens_per_expert=real_per_expert, layout=layout)
        self.over_budget = overflow
        if bad_ids is not None:
            self.invalid_expert_ids = bad_ids
        rows = (out, out_scales) if fp8 else out
        return DispatchOutput(rows, out_probs, tokens_per_expert, handle)

    def _dispatch_again(self, hidden, handle: Handle) -> torch.Tensor:
        self.buffer.raise_if_timed_out()
        layout: HybridLayout = handle.layout
        H = self.hidden_size
        with nvtx_range("ep.hybrid.dispatch_again.notify"):
            self._notify(PHASE_DISPATCH_AGAIN)
        with nvtx_range("ep.hybrid.dispatch_again.send"):
            hidden = self._aligned(hidden)
            self._keep_on_stream(hidden)
            self._C.dispatch_send(self.buffer.raw, hidden.data_ptr(), 2 * H, 0, 0, layout.send_slot.data_ptr(), 0, 0,
                                  handle.num_tokens, self._bulk, self.num_blocks, self._stream())
        with nvtx_range("ep.hybrid.dispatch_again.permute"):
            out = self._empty(layout.budget, H, dtype=hidden.dtype)
            self._C.permute(self.buffer.raw, out.data_ptr(), 2 * H, 0, 0, 0, layout.budget,
                            layout.row_base.data_ptr(), layout.expert_start.data_ptr(),
                            handle.tokens_per_expert.data_ptr(), handle.num_real_tokens_per_expert.data_ptr(),
                            layout.num_packets.data_ptr(), layout.total_rows.data_ptr(), layout.packet_rows.data_ptr(),
                            1, layout.overflow.data_ptr(), self._bulk, self.num_blocks, self._stream())
        return out

    def _combine(self, rows, handle: Handle, row_probs) -> CombineOutput:
        self.buffer.raise_if_timed_out()
        layout: HybridLayout = handle.layout
        T, dev = handle.num_tokens, self.device
        with nvtx_range("ep.hybrid.combine.notify"):
            self._notify(PHASE_COMBINE)
        with nvtx_range("ep.hybrid.combine.send"):
            self._keep_on_stream(rows, row_probs)
            self._C.combine_send(self.buffer.raw, rows.data_ptr(), row_probs.data_ptr() if row_probs is not None else 0,
                                 layout.packet_rows.data_ptr(), layout.num_packets.data_ptr(), layout.budget,
                                 self.num_blocks, self._stream())
        with nvtx_range("ep.hybrid.combine.receive"):
            out = torch.empty(T, self.hidden_size, dtype=torch.bfloat16, device=dev)
            dense_probs = torch.zeros(T, self.num_experts, dtype=torch.float32, device=dev) \
                if row_probs is not None else None
            self._C.combine_recv(self.buffer.raw, out.data_ptr(),
                                 dense_probs.data_ptr() if dense_probs is not None else 0,
                                 layout.send_slot.data_ptr(), layout.k_index.data_ptr(), T, self.num_blocks,
                                 self._stream())
        probs = None
        if dense_probs is not None:
            if layout.topk_idx is None:
                probs = dense_probs
            else:
                idx = layout.topk_idx
                valid = (idx >= 0) & (idx < self.num_experts)
                probs = dense_probs.gather(1, torch.where(valid, idx, torch.zeros_like(idx))) * valid
        return CombineOutput(out, probs)

    # ---- lifecycle / errors ---------------------------------------------------------------

    def check_errors(self, synchronize: bool = True) -> None:
        """Raise EPTimeoutError if a device wait timed out (optionally after syncing the device), and
        ValueError if a non-blocking top-k dispatch held expert ids out of range (they were dropped)."""
        if synchronize:
            torch.cuda.synchronize(self.device)
        self.buffer.raise_if_timed_out()
        if synchronize and self.invalid_expert_ids is not None and bool(self.invalid_expert_ids):
            self.invalid_expert_ids = None
            raise ValueError(f"a non-blocking dispatch got topk_idx values outside -1 or [0, {self.num_experts}); "
                             "those pairs were dropped")

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        super().barrier()

    def destroy(self) -> None:
        self.buffer.destroy()
