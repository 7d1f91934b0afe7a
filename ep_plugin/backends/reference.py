"""``reference``: dispatch/combine through ``torch.distributed.all_to_all_single`` with exact counts.

The correctness oracle for every other backend, and an always-available fallback. It
sends one row per (token, expert) pair, reads counts on the host, and reorders with
plain torch indexing. Works on gloo (CPU, or CUDA tensors staged through the host) and
on NCCL.

Row order of the dispatch output (the contract all backends share): local expert
ascending; within an expert, source rank ascending, then source token ascending; each
expert segment zero-padded to a multiple of ``pad_multiple``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..handle import CombineOutput, DispatchOutput, Handle
from ..routing import Routing
from .base import Backend, Capabilities


@dataclass(eq=False)
class ReferenceLayout:
    """Index tensors of one dispatch. Send side is ordered (dest rank, token, expert)."""

    send_token: torch.Tensor  # [P] int64: source token of each sent pair
    send_slot: torch.Tensor  # [P] int64: index of the pair's prob in the flattened probs
    send_splits: list[int]  # pairs sent to each rank
    recv_splits: list[int]  # pairs received from each rank
    recv_row: torch.Tensor  # [Q] int64: output row of each received pair (receive order)


class ReferenceBackend(Backend):
    name = "reference"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        hidden_dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
        probs_dtypes=(torch.float32, torch.float64),
    )

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None) -> None:
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device)
        # gloo moves CPU tensors only: stage CUDA tensors through the host there.
        self._stage_on_host = self.device.type == "cuda" and dist.get_backend(self.group) != "nccl"

    def _dispatch(self, hidden, routing: Routing, probs, pad_multiple) -> DispatchOutput:
        layout, real_counts, padded_counts = self._make_layout(routing, pad_multiple)
        num_rows = int(padded_counts.sum())
        handle = Handle(
            backend=self, num_tokens=routing.num_tokens, hidden_size=self.hidden_size, hidden_dtype=hidden.dtype,
            probs_shape=routing.probs_shape if probs is not None else None, num_experts=self.num_experts,
            num_local_experts=self.num_local_experts, pad_multiple=pad_multiple, num_rows=num_rows,
            tokens_per_expert=padded_counts, num_real_tokens_per_expert=real_counts, layout=layout)
        rows = self._dispatch_again(hidden, handle)
        row_probs = None
        if probs is not None:
            sent = probs.reshape(-1)[layout.send_slot]
            row_probs = probs.new_zeros(num_rows)
            row_probs[layout.recv_row] = self._all_to_all(sent, layout.recv_splits, layout.send_splits)
        return DispatchOutput(rows, row_probs, padded_counts, handle)

    def _dispatch_again(self, hidden, handle: Handle) -> torch.Tensor:
        layout = handle.layout
        received = self._all_to_all(hidden[layout.send_token], layout.recv_splits, layout.send_splits)
        rows = hidden.new_zeros(handle.num_rows, self.hidden_size)
        rows[layout.recv_row] = received
        return rows

    def _combine(self, rows, handle: Handle, row_probs) -> CombineOutput:
        layout = handle.layout
        returned = self._all_to_all(rows[layout.recv_row], layout.send_splits, layout.recv_splits)
        # Accumulate in fp32 (or fp64) whatever the payload dtype; pairs of a token add in expert order.
        accumulate_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
        summed = torch.zeros(handle.num_tokens, self.hidden_size, dtype=accumulate_dtype, device=rows.device)
        summed.index_add_(0, layout.send_token, returned.to(accumulate_dtype))
        probs = None
        if row_probs is not None:
            returned_probs = self._all_to_all(row_probs[layout.recv_row], layout.send_splits, layout.recv_splits)
            probs = row_probs.new_zeros(handle.probs_shape)
            probs.view(-1)[layout.send_slot] = returned_probs
        return CombineOutput(summed.to(rows.dtype), probs)

    # ---- helpers ------------------------------------------------------------------------

    def _make_layout(self, routing: Routing, pad_multiple: int):
        token, expert, slot = routing.pairs()
        dest_rank = torch.div(expert, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(dest_rank, stable=True)  # (dest rank, token, expert)
        send_local_expert = (expert % self.num_local_experts)[order]
        send_counts = torch.bincount(dest_rank, minlength=self.num_ranks)
        recv_counts = self._all_to_all(send_counts, [1] * self.num_ranks, [1] * self.num_ranks)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_local_expert = self._all_to_all(send_local_expert, recv_splits, send_splits)

        # Received pairs arrive as (source rank, token, expert); a stable sort by local expert
        # gives the contract order (local expert, source rank, token).
        by_expert = torch.argsort(recv_local_expert, stable=True)
        real_counts = torch.bincount(recv_local_expert, minlength=self.num_local_experts)
        padded_counts = (real_counts + pad_multiple - 1) // pad_multiple * pad_multiple
        real_starts = torch.cumsum(real_counts, 0) - real_counts
        padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
        sorted_expert = recv_local_expert[by_expert]
        rank_in_expert = torch.arange(len(by_expert), device=by_expert.device) - real_starts[sorted_expert]
        recv_row = torch.empty_like(by_expert)
        recv_row[by_expert] = padded_starts[sorted_expert] + rank_in_expert

        layout = ReferenceLayout(send_token=token[order], send_slot=slot[order], send_splits=send_splits,
                                 recv_splits=recv_splits, recv_row=recv_row)
        return layout, real_counts, padded_counts

    def _all_to_all(self, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """all_to_all_single along dim 0 with exact split sizes."""
        device = tensor.device
        if self._stage_on_host:
            tensor = tensor.cpu()
        out = tensor.new_empty((sum(out_splits),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=self.group)
        return out.to(device)
