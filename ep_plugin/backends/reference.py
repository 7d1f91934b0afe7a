"""``reference``: dispatch/combine through ``torch.distributed.all_to_all_single`` with exact counts.

The correctness oracle for every other backend, and an always-available fallback. It
sends one row per (token, expert) pair, reads counts on the host, and reorders with
plain torch indexing. Works on gloo (CPU, or CUDA tensors staged through the host) and
on NCCL.

Row order of the dispatch output (the contract all backends share): local expert
ascending; within an expert, source rank ascending, then source token ascending; each
expert segment zero-padded to a multiple of ``pad_multiple``.

Agreement: every op (dispatch, dispatch_again, combine, barrier) opens with one small
all-to-all of four int64 per pair of ranks: the rows the sender will send to that peer, the
op's ``OpFingerprint``, the number of this backend among the reference backends built on the
group (ranks must use their backends in the same order), and the probs dtype. A rank whose top-k ids
are out of range or name an expert twice announces -1 rows, one with more tokens than max_tokens_per_rank
-2 rows: every rank then raises ``ValueError``
(the backend stays usable), as the compiled backends do, instead of the others timing out. For dispatch
this is the count exchange it needs anyway; dispatch_again, combine and barrier have no count
exchange of their own, so for them it is one extra small collective and one host read. Every
rank compares what each peer sent with its own before any payload moves; a difference raises
``EPError`` on every rank (each receives every peer's fingerprint, so if any two ranks differ,
every rank sees a peer that differs from itself). No payload collective ran, so the backend
stays usable. On an NCCL group these words go over its gloo twin (``host_collectives``), so that a
rank that stops calling leaves no NCCL kernel waiting on a GPU. The ops of a reference backend are
sequential on the host: a fingerprint names the handle a combine uses by its dispatch number, so two
ranks combining two handles in opposite orders disagree there.

Timeouts: every collective is waited with ``config.timeout_s`` (``HostCollectives``); a late
or missing peer raises ``EPTimeoutError`` naming this rank, the op and phase, and the peer. An
engine failure raises ``EPError`` with the engine's message. After either the backend refuses
further ops: the group's collectives are out of step among its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..agreement import (
    OP_BARRIER,
    OP_COMBINE,
    OP_DISPATCH,
    OP_DISPATCH_AGAIN,
    TOPK_FIELD_MAX,
    OpFingerprint,
    met_a_setup_step_error,
    mismatch_message,
    ordinal,
)
from ..errors import EPError, TooManyTokensError
from ..handle import CombineOutput, DispatchOutput, Handle
from ..host_collectives import (
    FRAME_WORDS,
    SETUP_EXCHANGE,
    HostCollectives,
    between_exchanges,
    moves_host_memory,
)
from ..routing import TOPK, Routing
from .base import Backend, Capabilities

# Codes of the probs dtype in the opening exchange (0 = the op carries no probs).
_PROBS_DTYPES = (None, torch.float32, torch.float64)
_OPEN_WORDS = FRAME_WORDS  # per pair of ranks: rows sent, fingerprint, backend number, probs dtype
# The rows count a rank announces when it refused its dispatch's input: its top-k ids, or its token count.
_REFUSED_IDS, _REFUSED_TOKENS = -1, -2


@dataclass(eq=False)
class ReferenceLayout:
    """Index tensors of one dispatch. Send side is ordered (dest rank, token, expert)."""

    dispatch_id: int  # this dispatch's number on its backend (from 1): the handle_id of its combine
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
    refuses_input_in_exchange = True  # announced as negative rows in the opening exchange (see _open)

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None, topology=None) -> None:
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device,
                         topology=topology)
        # Where the group moves host memory (gloo, or torch's default "cpu:gloo,cuda:nccl"), stage CUDA tensors
        # through the host: that works with ranks sharing a GPU too, which NCCL refuses.
        self._stage_on_host = self.device.type == "cuda" and moves_host_memory(dist.get_backend(self.group))
        self._exchange_device = self.device if self.device.type == "cuda" and not self._stage_on_host else "cpu"
        self._comm = HostCollectives(self.group, owner="ep_plugin reference", timeout_s=self.config.timeout_s,
                                     label="reference", device=self.device)
        # The opening exchange's words, which the host reads: over NCCL, on the group's gloo twin (a rank that
        # stops calling then leaves no NCCL kernel waiting on the GPU; see host_collectives), else on _comm.
        self._words = self._comm
        if not moves_host_memory(self._comm.engine) and self.config.gloo_host_words:
            self._words = HostCollectives(self.group, owner="ep_plugin reference", timeout_s=self.config.timeout_s,
                                          label="reference words", device=self.device, on_host=True)
            # One place in the store for both: a timeout on either names where a peer gave up on the other.
            self._words.site = self._comm.site
        self._num_dispatches = 0  # counts only dispatches that all ranks agreed on

    def _dispatch(self, hidden, routing: Routing, probs, pad_multiple) -> DispatchOutput:
        number = self._num_dispatches + 1
        where = f"dispatch #{number}"
        topk = min(routing.topk_idx.shape[1], TOPK_FIELD_MAX) if routing.form == TOPK else 0
        fingerprint = OpFingerprint(OP_DISPATCH, dtype=hidden.dtype, probs=probs is not None, form=routing.form,
                                    topk=topk, grad=self.op_records_backward, probs_grad=self.op_probs_need_grad)
        refused = self._refused_input(routing)
        if refused is None:
            token, expert, slot = routing.pairs()
            dest_rank = torch.div(expert, self.num_local_experts, rounding_mode="floor")
            send_splits = torch.bincount(dest_rank, minlength=self.num_ranks).tolist()
        else:  # the opening exchange tells every rank, and every rank raises ValueError
            over = routing.num_tokens > self.config.max_tokens_per_rank
            send_splits = [_REFUSED_TOKENS if over else _REFUSED_IDS] * self.num_ranks
        recv_splits = self._open(fingerprint, where, send_splits, None if probs is None else probs.dtype,
                                 refused=refused)
        self._num_dispatches = number

        with self._after_opening(where):
            layout, real_counts, padded_counts = self._make_layout(number, token, expert, slot, dest_rank,
                                                                   send_splits, recv_splits, pad_multiple, where)
            padded_list = padded_counts.tolist()  # one host read for the row count and the host copy
            num_rows = sum(padded_list)
            handle = Handle(
                backend=self, num_tokens=routing.num_tokens, hidden_size=self.hidden_size, hidden_dtype=hidden.dtype,
                probs_shape=routing.probs_shape if probs is not None else None, num_experts=self.num_experts,
                num_local_experts=self.num_local_experts, pad_multiple=pad_multiple, num_rows=num_rows,
                tokens_per_expert=padded_counts, num_real_tokens_per_expert=real_counts, layout=layout)
            rows = self._send_rows(hidden, handle, f"{where} (rows)")
            row_probs = None
            if probs is not None:
                sent = probs.reshape(-1)[layout.send_slot]
                row_probs = probs.new_zeros(num_rows)
                row_probs[layout.recv_row] = self._all_to_all(sent, layout.recv_splits, layout.send_splits,
                                                              f"{where} (probs)")
        return DispatchOutput(rows, row_probs, padded_counts, handle, tokens_per_expert_list=padded_list)

    def _dispatch_again(self, hidden, handle: Handle) -> torch.Tensor:
        layout: ReferenceLayout = handle.layout
        where = f"dispatch_again along dispatch #{layout.dispatch_id}"
        # grad: a cached dispatch through ep_plugin.dispatch may be recorded (a backward's dispatch_again never is)
        fingerprint = OpFingerprint(OP_DISPATCH_AGAIN, dtype=hidden.dtype, handle_id=layout.dispatch_id,
                                    grad=self.op_records_backward)
        self._open(fingerprint, where, layout.send_splits, None, expected=layout.recv_splits)
        with self._after_opening(where):
            return self._send_rows(hidden, handle, f"{where} (rows)")

    def _combine(self, rows, handle: Handle, row_probs) -> CombineOutput:
        layout: ReferenceLayout = handle.layout
        where = f"combine of dispatch #{layout.dispatch_id}"
        fingerprint = OpFingerprint(OP_COMBINE, dtype=rows.dtype, probs=row_probs is not None,
                                    handle_id=layout.dispatch_id, grad=self.op_records_backward)
        self._open(fingerprint, where, layout.recv_splits, None if row_probs is None else row_probs.dtype,
                   expected=layout.send_splits)
        with self._after_opening(where):
            returned = self._all_to_all(rows[layout.recv_row], layout.send_splits, layout.recv_splits,
                                        f"{where} (rows)")
            # Accumulate in fp32 (or fp64) whatever the payload dtype. On CUDA index_add_ adds a token's pairs in no
            # set order (atomics), so a sum of three or more can differ in its last bit from run to run; exact on CPU.
            accumulate_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
            summed = torch.zeros(handle.num_tokens, self.hidden_size, dtype=accumulate_dtype, device=rows.device)
            summed.index_add_(0, layout.send_token, returned.to(accumulate_dtype))
            probs = None
            if row_probs is not None:
                returned_probs = self._all_to_all(row_probs[layout.recv_row], layout.send_splits, layout.recv_splits,
                                                  f"{where} (probs)")
                probs = row_probs.new_zeros(handle.probs_shape)
                probs.view(-1)[layout.send_slot] = returned_probs
        return CombineOutput(summed.to(rows.dtype), probs)

    def _barrier(self) -> None:
        """Block until every rank of the group reaches this point with the work it queued on its GPU done
        (timed, and checked like an op). The opening exchange alone is a host meeting where it goes over
        gloo, so each rank first waits for its own stream."""
        self._wait_for_host("the barrier (this rank's queued work)")
        nothing = [0] * self.num_ranks
        self._open(OpFingerprint(OP_BARRIER), "barrier", nothing, None, expected=nothing)

    # ---- helpers ------------------------------------------------------------------------

    def _after_opening(self, where: str):
        """The rest of an op once its opening exchange agreed (``host_collectives.between_exchanges``)."""
        return between_exchanges(where, (self._comm, self._words))

    def destroy(self) -> None:
        self._words.release()
        super().destroy()

    def check_usable(self) -> None:
        """Also the collectives the ops run on (``_comm``): after one timed out, the next op raises at once."""
        super().check_usable()
        self._comm.check_usable()
        self._words.check_usable()

    def _open(self, fingerprint: OpFingerprint, where: str, send_splits: list[int],
              probs_dtype: Optional[torch.dtype], *, expected: Optional[list[int]] = None,
              refused: Optional[str] = None) -> list[int]:
        """The exchange every op starts with (see the module docstring); returns each peer's row count.

        Raises EPError on every rank when the ranks disagree, before any payload moves; else ValueError on
        every rank when a rank refused its input (``refused``: why, on that rank; it sends -1 rows for its top-k
        ids, -2 for its token count).
        ``expected``: the rows each peer should announce (known from the handle), checked too.
        """
        # Over NCCL the words travel on the gloo twin, whose own check misses a timeout of the NCCL ops (_comm):
        # without this the next op waited out another timeout and blamed a peer.
        self.check_usable()
        fingerprint_word, instance, probs_code = mine = (fingerprint.pack(), self._comm.instance,
                                                         _PROBS_DTYPES.index(probs_dtype))
        sent = torch.tensor([(count,) + mine for count in send_splits], dtype=torch.int64,
                            device=self._words.word_device)
        words = [_OPEN_WORDS] * self.num_ranks
        received = self._words.all_to_all(sent.view(-1), words, words, where=f"{where} (opening exchange)")
        rows = received.view(self.num_ranks, _OPEN_WORDS).tolist()
        counts = [row[0] for row in rows]
        theirs = [tuple(row[1:]) for row in rows]

        def differing(field: int) -> list[int]:
            return [q for q in range(self.num_ranks) if theirs[q][field] != mine[field]]

        in_setup = [q for q in range(self.num_ranks) if theirs[q][0] == SETUP_EXCHANGE]
        late = (in_setup or differing(0) or differing(1) or differing(2)) and self._words.came_late_error(
            f"{where} (opening exchange)", (self._comm,))
        if late:  # a peer gave up waiting for this rank: what differs is the call it left behind
            raise late
        if in_setup:  # a peer building a backend (or another setup step) met this op: one frame size, no abort
            raise met_a_setup_step_error(self.name, self._comm.peer_name(self.rank), where,
                                         [self._comm.peer_name(q) for q in in_setup], "this process group")

        if differing(1):  # first: other fields mean nothing when the ops ran on different backends
            q = differing(1)[0]
            raise EPError(
                f"ep_plugin reference: ranks disagree on {where}: {self._comm.peer_name(self.rank)} ran it on the "
                f"reference backend built {ordinal(instance)} on this process group, {self._comm.peer_name(q)} on "
                f"the one built {ordinal(theirs[q][1])}. Ranks must use their backends in the same order.")
        if differing(0):
            bad = differing(0)
            raise EPError(mismatch_message(self.name, self.rank, bad[0], fingerprint_word, theirs[bad[0]][0],
                                           self._comm.peer_name)
                          + f" {self._comm.peer_name(self.rank).capitalize()} was in {where}; ranks whose op differs "
                          f"from its: {', '.join(self._comm.peer_name(q) for q in bad)}.")
        if differing(2):
            q = differing(2)[0]
            # A word past the codes: another call's frame on this group (a domain stage of a backend across domains
            # run beside this domain backend's op), whose fourth word is no probs dtype.
            theirs_probs = _PROBS_DTYPES[theirs[q][2]] if 0 <= theirs[q][2] < len(_PROBS_DTYPES) else \
                f"another call's word ({theirs[q][2]})"
            raise EPError(
                f"ep_plugin reference: ranks disagree on {where}: probs dtype: {_PROBS_DTYPES[probs_code]} on "
                f"{self._comm.peer_name(self.rank)}, {theirs_probs} on {self._comm.peer_name(q)}. All "
                "ranks must pass probs of one dtype.")
        refusing = [q for q in range(self.num_ranks) if counts[q] in (_REFUSED_IDS, _REFUSED_TOKENS)]
        if refusing:
            stays = "every rank of backend 'reference' refused this dispatch; the backend stays usable"
            # Every rank sees the same counts, so every rank picks the same class.
            error = ValueError if _REFUSED_IDS in counts else TooManyTokensError
            if refused is not None:
                raise error(f"{refused} (on rank {self.rank}); {stays}")
            why = []
            ids = [q for q in refusing if counts[q] == _REFUSED_IDS]
            if ids:
                why.append(f"rank(s) {ids} of the group passed topk_idx with an expert id outside -1 and "
                           f"[0, {self.num_experts}) or a token naming the same expert twice")
            tokens = [q for q in refusing if counts[q] == _REFUSED_TOKENS]
            if tokens:
                why.append(f"rank(s) {tokens} of the group passed {self._too_many_tokens()}")
            raise error(f"{'; '.join(why)}: {stays}")
        if expected is not None and counts != expected:
            raise EPError(f"ep_plugin reference: rank {self.rank}: in {where} the peers announce {counts} rows, the "
                          f"handle expects {expected}; the ranks' handles come from different dispatches.")
        return counts

    def _make_layout(self, number: int, token, expert, slot, dest_rank, send_splits: list[int],
                     recv_splits: list[int], pad_multiple: int, where: str):
        order = torch.argsort(dest_rank, stable=True)  # (dest rank, token, expert)
        send_local_expert = (expert % self.num_local_experts)[order]
        recv_local_expert = self._all_to_all(send_local_expert, recv_splits, send_splits, f"{where} (expert ids)",
                                             read_on_host=True)

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

        layout = ReferenceLayout(dispatch_id=number, send_token=token[order], send_slot=slot[order],
                                 send_splits=send_splits, recv_splits=recv_splits, recv_row=recv_row)
        return layout, real_counts, padded_counts

    def _send_rows(self, hidden: torch.Tensor, handle: Handle, where: str) -> torch.Tensor:
        layout: ReferenceLayout = handle.layout
        received = self._all_to_all(hidden[layout.send_token], layout.recv_splits, layout.send_splits, where)
        rows = hidden.new_zeros(handle.num_rows, self.hidden_size)
        rows[layout.recv_row] = received
        return rows

    def _all_to_all(self, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int], where: str, *,
                    read_on_host: bool = False) -> torch.Tensor:
        """all_to_all_single along dim 0 with exact split sizes, waited with the timeout."""
        device = tensor.device
        if self._stage_on_host:
            tensor = tensor.cpu()
        out = self._comm.all_to_all(tensor, out_splits, in_splits, where=where, read_on_host=read_on_host)
        return out.to(device)


