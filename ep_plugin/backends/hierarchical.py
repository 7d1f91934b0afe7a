"""Dispatch/combine across NVLink domains: any backend inside each domain, the rails between them.

``HierarchicalBackend`` is what a backend's constructor returns when the group's topology has more
than one domain (see ``Backend``): it builds the requested backend (the *domain backend*) on each
domain's process group and joins the domains over the rails (``transport.scaleout``). Same API,
capabilities, handle semantics and results as the flat backend on the whole group.

Data path, for a rank in domain d at local index l (S ranks per domain, D domains, G = S * L experts
per domain):

1. dispatch, rail stage: each token goes once to every domain that holds any of its experts, to the
   rail peer (that domain's rank at local index l), with its routing restricted to that domain (the
   routing map's G columns; top-k ids made domain-local, -1 elsewhere) and its probs, packed as bytes
   in one rail collective. Blocking mode exchanges exact counts first (with the op's agreement words,
   below); sync-free mode agrees first, then sends ``max_tokens_per_rank`` rows to every rail peer,
   the unused ones routed nowhere (no count is read).
2. dispatch, domain stage: the domain backend dispatches the received rows (source domain order, then
   source token) inside the domain, with G experts, the same pad_multiple and options.
3. reorder: within each expert segment (or the one compact segment) the domain backend's rows come
   by forwarding peer, then source domain; the flat order is by source rank = (source domain, peer).
   The rows (and probs, top-k ids) are moved with one index (``flat_order_index``, device ops only),
   from per-(peer, source domain, segment) counts exchanged once in the domain. The result equals the
   flat backend's bitwise: payloads, row order, probs, ``tokens_per_expert``, ``num_valid_rows``.
   Except after an overflow (non-blocking mode, ``num_permuted_tokens`` below what arrived; the domain
   backend's ``over_budget`` is set): the domain backend dropped the rows past the budget in its own
   order, not in the flat one, so the output's rows are then unspecified, also below the budget (the
   flat backend keeps the first rows in its order). Treat an overflow as an error there.
4. combine: rows go back to the domain-level order, the domain backend combines them (one partial sum
   per received row, rounded to the payload dtype), the partials go back over the rail (one row per
   (token, destination domain)), and the source adds them in fp32 in domain order, rounds once.
   Tolerance against the flat backend: payloads that sum exactly (as in the tests) are bitwise equal;
   otherwise each domain's partial is rounded once, so a token whose experts span several domains can
   differ by about one ulp of the payload dtype per domain (bf16: |err| <= D * 2**-8 * max|partial|).
   Probs sent back are not summed: equal bitwise.
5. dispatch_again (backward of combine) and a cached dispatch (``handle=``) follow the same rail and
   domain layout; backward of dispatch is combine. Gradients flow through ``ep_plugin.dispatch`` /
   ``ep_plugin.combine`` as for any backend (the outer Handle belongs to this backend).

``barrier()`` is global by construction: the op agreement's rail stage, then its domain stage, one
after the other (a rank leaves only after every rank of its domain finished its rail stage, so after
every rank of every domain entered), then the domain backend's barrier. On a GPU the host first waits
for this rank's stream (with the timeout): every kernel that stored into NVLink peers has completed,
which orders those stores before the scale-out traffic of the barrier (the system-scope fence of a
device-side barrier).

Errors: a rail wait that runs past ``timeout_s`` raises ``EPTimeoutError`` naming the rail, the op and
phase (``rail/counts``, ``rail/agreement``, ``rail/tokens``, ``rail/rows``) and the late peer; an engine
failure raises ``EPError`` with the engine's message; a domain-level failure is re-raised with the
domain named. After any of them the backend is unusable (build a new one on a new process group).

Agreement: ranks that run different ops, or one op with a different dtype, probs, routing form, top-k or
handle, raise ``EPError`` on every rank before the domain backend is called; the backend stays usable
(every rank left the same collectives). Top-k ids out of range or repeated on one rank raise
``ValueError`` on every rank the same way: the rank that checked them says so in its agreement words
(not in sync-free mode on a backend that has one: no host read there, the domain backend drops them).
Where ranks disagree and a rank refused in one op, every rank raises ``EPError``, as flat.
Every op opens with two exchanges of a fixed size per peer, whatever the op (blocking dispatch's segment counts
follow in a third): the rail stage (the op
fingerprint, the width of its rail rows, the backend's number on its group and whether the rank refused its
input; in blocking mode inside the count exchange) and the domain
stage (whether this rank's rail found a disagreement, and the fingerprint: one frame of
``host_collectives.FRAME_WORDS``, the size of the domain backend's own setup calls on that group; blocking
dispatch sends its segment counts in a second exchange once the domain agreed). So ranks that disagree always
meet in an exchange of one size, never in two different collectives or one of two sizes (gloo aborts the
process on those). A
rail that disagrees flags on all its ranks and has a rank in every domain; where every rail agrees, two
fingerprints differ by local index, which every domain holds: either way every rank stops (see
``_domain_agreement``). Blocking dispatch runs its domain stage after the rail payload (it needs the
counts), other ops before any rows move. Cost: in blocking mode one small domain exchange per combine,
dispatch_again, cached dispatch and barrier, and two per dispatch (the frame, then the counts); in sync-free
mode two small host exchanges per op. Both modes' words (and blocking mode's counts) are CPU tensors over gloo, a gloo
twin of an NCCL rail or domain group (no wait for the GPU), which the host waits for with the timeout; a
peer that stops there leaves no NCCL collective queued, and backends of both modes meet in one size.

Costs and limits: the rail stages, the reorder and the sums are torch ops and host-issued
collectives around the domain backend's kernels; on a gloo rail CUDA tensors are staged through
host memory (kept pinned buffers; a rank's rows for its own domain stay on the GPU), which waits for
the stream, also in sync-free mode (``transport.scaleout``). The
capabilities are the domain backend's except ``cuda_graphs`` (not claimed: the rail collectives are
issued from the host). A top-k wider than the experts of one domain (k > S * L) is refused in the
op's opening agreement, on every rank alike (ValueError), before any row moves. The domain
backend's buffers are sized for ``D * max_tokens_per_rank`` input rows (it forwards up to that many),
the same bytes per rank as the flat backend on the whole group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from ..agreement import (
    OP_BARRIER,
    OP_COMBINE,
    OP_DISPATCH,
    OP_DISPATCH_AGAIN,
    TOPK_FIELD_MAX,
    WHAT_RANKS_SHARE,
    OpFingerprint,
    met_a_setup_step_error,
    mismatch_message,
    ordinal,
)
from ..errors import EPError, TooManyTokensError
from ..handle import COMPACT, CombineOutput, DispatchOutput, Handle
from ..host_collectives import FRAME_WORDS, SETUP_EXCHANGE, HostCollectives, between_exchanges, moves_host_memory
from ..routing import ROUTING_MAP, TOPK, Routing, check_tensor, dropped_ids_error
from ..topology import Topology
from ..transport.scaleout import RailSplits, RowPacker, ScaleOut, flat_order_index
from .base import Backend

# The rail agreement's refusal word of a rank whose dispatch input was refused (see _rail_agreement; 0: none).
_REFUSED_INPUT = -1
_REFUSED_TOKENS = -2  # ... by one whose only reason was its token count (more than max_tokens_per_rank)


class RefusedInput(str):
    """A disagreement that is a refused dispatch input (top-k ids, more tokens than max_tokens_per_rank):
    every rank raises ValueError, not EPError, and the backend stays usable, as a flat compiled backend
    refuses bad ids on every rank."""


class RefusedTokens(RefusedInput):
    """A refused dispatch input whose only reason, on every refusing rank seen so far, is the token count:
    TooManyTokensError where every rail of the group saw no other (``_domain_agreement``)."""


@dataclass(eq=False)
class HierarchicalLayout:
    """What combine, dispatch_again and a cached dispatch need of one hierarchical dispatch."""

    dispatch_id: int  # this dispatch's number on its backend (from 1)
    domain_handle: Handle  # the domain backend's handle of the forwarded rows
    to_domain: torch.Tensor  # [T, D] bool: the token went to that domain
    send_tokens: Optional[list[torch.Tensor]]  # blocking: tokens sent to each domain, in token order
    send_slot: Optional[torch.Tensor]  # sync-free: [T, D] int64 row of the token in the domain's block
    splits: RailSplits  # rows sent to / received from each rail peer
    slot_domain: Optional[torch.Tensor]  # top-k: [T, k] domain of each slot's expert (D = none)
    dest: torch.Tensor  # [num_rows] int64: flat row of each domain-level row
    # hybrid's flag, as on a flat backend: [1] int32, 1 when rows fell past the non-blocking budget (None
    # where the domain backend has none)
    overflow: Optional[torch.Tensor] = None


class HierarchicalBackend(Backend):
    """A domain backend in every NVLink domain, joined over the rails (see the module docstring).

    Args (beyond every backend's): domain_backend: the backend class to run inside each domain;
    topology: the group's topology (more than one domain); domain_options: extra constructor
    arguments of the domain backend (``max_topk`` for elastic).
    """

    _spans_domains = True
    refuses_input_in_exchange = True  # in the rail agreement word and the domain flag

    def __init__(self, group=None, *, domain_backend: type, topology: Topology, hidden_size: int, num_experts: int,
                 config=None, device=None, **domain_options: Any) -> None:
        self.name = domain_backend.name
        # The rail collectives are issued from the host: no claim that a CUDA graph can capture them.
        self.capabilities = dataclasses.replace(domain_backend.capabilities, cuda_graphs=False)
        self.domain_backend_class = domain_backend
        domain_options.pop("combine_input_rows", None)  # no arena in the domain (see below), asked for or not
        self._domain_options = domain_options
        self._topology = topology
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device,
                         topology=topology)
        S, D = topology.domain_size, topology.num_domains
        self.domain_size, self.num_domains = S, D
        self.experts_per_domain = S * self.num_local_experts
        self.scaleout = ScaleOut(self.group, topology, self.device, timeout_s=self.config.timeout_s,
                                 chunk_rows=self.config.scaleout_chunk_tokens, owner=f"ep_plugin {self.name}",
                                 gloo_host_words=self.config.gloo_host_words)
        domain_global = [torch.distributed.get_global_rank(self.group, r) for r in topology.domain_ranks()]
        self.domain_level = f"domain {topology.domain_index} (global ranks {domain_global})"
        # A rank forwards up to D * max_tokens_per_rank rows into its domain; the domain backend's outputs
        # then have the flat backend's worst case (S * D * T = world * T rows), and so does its buffer.
        # No combine-input arena in the domain: combine's input is the reorder's output, never a tensor
        # the user allocated there (an arena would be buffer memory that nothing uses).
        changes: dict[str, Any] = {"max_tokens_per_rank": D * self.config.max_tokens_per_rank,
                                   "combine_input_rows": 0}
        if self.config.forward_sms and domain_backend.needs_shared_memory:
            changes["num_sms"] = self.config.forward_sms  # the domain kernels are the forwarding
        # The GPU-sharing check inside the build: a domain that refuses there is heard of by every domain.
        self.domain = self._build_domain(lambda: self._check_gpu_sharing(domain_backend(
            self.scaleout.domain_group, hidden_size=hidden_size, num_experts=self.experts_per_domain,
            config=self.config.replace(**changes), device=self.device,
            topology=Topology.flat(S, topology.local_index), **domain_options), topology))
        # Its handles hand out the domain's counts: refused here too, before the rails move anything.
        self.kernels_read_handed_out_counts = self.domain.kernels_read_handed_out_counts
        self._domain_counts = HostCollectives(self.scaleout.domain_group, owner=f"ep_plugin {self.name} "
                                              f"{self.domain_level}", timeout_s=self.config.timeout_s,
                                              label="domain counts", device=self.device)
        # The domain agreement frames (and blocking dispatch's segment counts after them): CPU tensors, on the gloo
        # twin of an NCCL domain group (EP_PLUGIN_GLOO_HOST_WORDS=0: on the domain group, read after the GPU). A
        # peer that stops there leaves no NCCL collective queued, and backends of both modes meet in one size.
        self._domain_words = self._domain_counts
        if not moves_host_memory(self._domain_counts.engine) and self.config.gloo_host_words:
            self._domain_words = HostCollectives(self.scaleout.domain_group, owner=f"ep_plugin {self.name} "
                                                 f"{self.domain_level}", timeout_s=self.config.timeout_s,
                                                 label="domain words", device=self.device, on_host=True)
        self._num_dispatches = 0
        # Sync-free top-k dispatches: a device bool, whether any held an id out of range (check_errors raises).
        self._invalid_expert_ids: Optional[torch.Tensor] = None

    def _build_domain(self, build: Callable[[], Backend]) -> Backend:
        """Build the domain backend, then tell the whole group how every domain's build went.

        A domain backend checks its own settings over its domain only (a compiled one's num_sms, say), and
        can fail in one domain alone (out of memory, a co-residency limit): its ranks raise, and without
        this the other domains would go on and wait for them at their first op until the timeout. Now every
        rank raises: the failed ones their own error, the others naming them (ValueError when every
        failure was a ValueError, as for settings that differ, else EPError)."""
        try:
            domain, failure = self._at_domain_level(build), None
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others have heard of it
            domain, failure = None, exc
        outcome = None if failure is None else (type(failure).__name__, str(failure))
        try:
            outcomes = self._host.all_gather_object(outcome, where="building the domain backends")
        except EPError:
            # A rank whose build failed before its domain's own check left its domain peers waiting there until
            # the timeout, so they come here late and everyone's wait here ends first: each rank that failed
            # raises its own error (below, as it came), not the wait it caused (the others' messages lead
            # back to it).
            if failure is None:
                if domain is not None:  # built here, but no rank goes on: free its buffer, not keep it to exit
                    with contextlib.suppress(Exception):  # (the wait's report is what this rank raises)
                        domain.destroy()
                raise
            outcomes = None
        failed = {} if outcomes is None else {rank: o for rank, o in enumerate(outcomes) if o is not None}
        if outcomes is not None and not failed:
            return domain
        if domain is not None:
            domain.destroy()
        if failure is not None:
            try:
                raise failure
            finally:  # the traceback holds this frame (and self): no cycle keeping them to a full collection
                failure = domain = None
        first, (kind, message) = next(iter(failed.items()))
        error = ValueError if all(k == "ValueError" for k, _ in failed.values()) else EPError
        raise error(f"ep_plugin {self.name}: the domain backend could not be built on rank(s) {sorted(failed)} "
                    f"(rank {first}: {kind}: {message})")

    @staticmethod
    def _check_gpu_sharing(domain: Backend, topology: Topology) -> Backend:
        """``domain``, once its co-residency is checked with every rank on its GPU: the domain backend checked
        it for its own domain's ranks, but where domains share a GPU (forced domains on one host) their
        spin-waiting kernels run at once too. A collective of the domain (every rank of it raises or none);
        ``_build_domain`` tells the other domains."""
        check = getattr(domain, "_check_co_residency", None)
        gpus = [gpu for gpu in topology.gpu_of_rank if gpu is not None]
        if check is None or not gpus:
            return domain
        try:
            check(max(gpus.count(gpu) for gpu in gpus))
        except BaseException:
            with contextlib.suppress(Exception):  # the check's error is what this rank raises
                domain.destroy()
            raise
        return domain

    def _construction_facts(self) -> dict[str, Any]:
        # forward_sms becomes the domain backend's num_sms: checked here, so that a difference is named as the
        # knob the user set, not as the num_sms the domain's own check would see.
        return {**super()._construction_facts(), "domain_size": self._topology.domain_size,
                "scaleout_chunk_tokens": self.config.scaleout_chunk_tokens, "forward_sms": self.config.forward_sms,
                "domain_options": sorted(self._domain_options.items())}

    # ---- public entry points ------------------------------------------------------------------

    def dispatch(self, hidden, *, routing_map=None, probs=None, topk_idx=None, topk_weights=None,
                 pad_multiple: Optional[int] = None, handle: Optional[Handle] = None, **options) -> DispatchOutput:
        """As the domain backend's dispatch (``Backend.dispatch``), with the k limits of a domain (refused in the
        op's agreement, ``_refused_input``)."""
        if handle is not None:  # a cached dispatch: Backend.dispatch refuses routing arguments, checks options
            return super().dispatch(hidden, routing_map=routing_map, probs=probs, topk_idx=topk_idx,
                                    topk_weights=topk_weights, pad_multiple=pad_multiple, handle=handle, **options)
        self.check_routing_form(routing_map, topk_idx)
        return super().dispatch(hidden, routing_map=routing_map, probs=probs, topk_idx=topk_idx,
                                topk_weights=topk_weights, pad_multiple=pad_multiple, **options)

    def combine(self, rows, handle: Handle, *, row_probs=None, **options) -> CombineOutput:
        """As the domain backend's combine; elastic's ``bias`` [T, H] is added once, at the source."""
        if options.get("bias") is not None:
            self.check_handle(handle)
            check_tensor("bias", options["bias"], dtypes=self.capabilities.hidden_dtypes,
                         shape=(handle.num_tokens, self.hidden_size), device=self.device)
        return super().combine(rows, handle, row_probs=row_probs, **options)

    def combine_input(self, handle: Handle) -> torch.Tensor:
        """Refused (ValueError): across domains a domain backend's combine input is the reorder of the
        expert rows into rail order, never the tensor the experts wrote, so there is no buffer memory to hand
        out for them. Combine a tensor of your own (one pass more on the expert side)."""
        self.refuse_if_destroyed("combine_input")
        raise ValueError(f"combine_input: across NVLink domains ({self.num_domains} domains of {self.domain_size} "
                         "ranks) the rows are reordered for the rails before the domain combine reads them, so no "
                         "combine input lives in the buffer (combine_input_rows is ignored here); combine a tensor "
                         "of your own")

    @contextlib.contextmanager
    def combine_input_arena(self) -> Iterator[bool]:
        """As the one-domain backend's context, which yields whether allocations go to its arena: never
        across domains (see ``combine_input``), so what is allocated inside is ordinary memory, combined the
        two-stage way. Code written for one domain runs unchanged."""
        yield False

    def _barrier(self) -> None:
        """Every rank of every domain reached this point: the op agreement (rail, then domain stage), then
        the domain backend's barrier."""
        self.check_usable()
        # This rank's NVLink stores are complete before the rail traffic; the domain backend's wait raises
        # what its kernels reported (a peer that never arrived) rather than a bare timeout.
        self.domain._wait_for_host("the barrier (this rank's queued work)")
        # The ops' agreement (so a peer in another op sees the difference), then the domain backend's barrier.
        self._open(OpFingerprint(OP_BARRIER), 0, "barrier", send_counts=[0] * self.scaleout.num_domains)
        self._at_domain_level(self.domain.barrier)

    def destroy(self) -> None:
        try:
            self.domain.destroy()
        finally:  # the rest goes also where the domain backend's last wait failed
            self.scaleout.release()
            self._domain_counts.release()
            self._domain_words.release()
            super().destroy()

    def check_usable(self) -> None:
        """Every op's first check: an earlier failure at either level (the rail's or the domain's
        collectives, the domain backend's own) raises at once. Without the domain's, a rank whose domain
        stage had timed out entered the rail exchange of its next op and blamed a rail peer after another
        timeout."""
        super().check_usable()
        self.scaleout.check_usable()
        self._domain_counts.check_usable()
        self._domain_words.check_usable()
        self._at_domain_level(self.domain.check_usable)

    def check_errors(self, synchronize: bool = True) -> None:
        """The domain backend's pending device errors (compiled backends), raised with the domain named; then,
        after a sync, ValueError if a sync-free top-k dispatch held ids out of range (they went nowhere)."""
        check = getattr(self.domain, "check_errors", None)
        if check is not None:
            self._at_domain_level(lambda: check(synchronize))
        flagged = self._invalid_expert_ids
        if synchronize and flagged is not None and bool(flagged):
            self._invalid_expert_ids = None
            raise dropped_ids_error(self.num_experts)

    @property
    def over_budget(self) -> Optional[torch.Tensor]:
        """hybrid: the overflow flag of the latest dispatch (see ``HybridBackend``)."""
        return getattr(self.domain, "over_budget", None)

    def _refused_input(self, routing: Routing) -> Optional[str]:
        """``Backend._refused_input``, and a top-k wider than one domain can take: refused in the op's agreement
        (not before it), so that where some ranks pass such a k their peers raise too instead of waiting."""
        refused = super()._refused_input(routing)
        if refused is not None or routing.form != TOPK:
            return refused
        k = routing.topk_idx.shape[1]
        if k > self.experts_per_domain:
            return (f"topk_idx has k={k} columns, more than the {self.experts_per_domain} experts of one NVLink "
                    f"domain ({self.domain_size} ranks x {self.num_local_experts}); across domains k must be at most "
                    f"that (use larger domains, or the routing_map form where the backend takes it)")
        max_topk = getattr(self.domain, "max_topk", None)
        if max_topk is not None and k > max_topk:
            return f"topk_idx has k={k} columns; this {self.name} backend was built with max_topk={max_topk}"
        return None

    def check_dispatch_flags(self, **options) -> None:
        """The domain backend's option values (elastic's flags are bools), before any rail moves."""
        self.domain.check_dispatch_flags(**options)

    # ---- Backend protocol ---------------------------------------------------------------------

    def _dispatch(self, hidden, routing: Routing, probs, pad_multiple, **options) -> DispatchOutput:
        self.check_usable()
        self.check_dispatch_flags(**options)  # their names were checked; values before the rail exchange
        number = self._num_dispatches + 1
        where = f"dispatch #{number}"
        refused = self._refused_input(routing)  # the agreement tells every rank
        if refused is not None:
            refused = (RefusedTokens if routing.num_tokens > self.config.max_tokens_per_rank else RefusedInput)(refused)
        fp8 = isinstance(hidden, (tuple, list))
        data, scales = (hidden[0], hidden[1]) if fp8 else (hidden, None)
        T, D, G, E, L = routing.num_tokens, self.num_domains, self.experts_per_domain, self.num_experts, \
            self.num_local_experts
        dev = data.device
        slot_domain, flagged = None, None
        if routing.form == ROUTING_MAP:
            to_domain = routing.routing_map.view(T, D, G).any(2)
        else:
            idx = routing.topk_idx
            slot_domain = torch.where((idx >= 0) & (idx < E), torch.div(idx, G, rounding_mode="floor"),
                                      torch.full_like(idx, D))
            to_domain = torch.zeros(T, D + 1, dtype=torch.bool, device=dev).scatter_(1, slot_domain, True)[:, :D]
            to_domain = to_domain.contiguous()
            if self._sync_free():  # no host read here: such ids go to no domain, and check_errors reports them
                flagged = ((idx < -1) | (idx >= E)).any()  # kept once the ranks agreed on the op (below)
        send_tokens, send_slot = self._rail_layout(to_domain)

        k = routing.topk_idx.shape[1] if routing.form == TOPK else 0
        fields = [("hidden", data.dtype, (self.hidden_size,))]
        if fp8:
            fields.append(("scales", torch.float32, (self.hidden_size // self.FP8_BLOCK,)))
        fields.append(("route", torch.bool, (G,)) if routing.form == ROUTING_MAP else ("route", torch.int64, (k,)))
        if probs is not None:
            fields.append(("probs", probs.dtype, (G,) if routing.form == ROUTING_MAP else (k,)))
        packer = RowPacker(fields)

        payload_rows = data.view(torch.uint8) if fp8 else data  # indexed as bytes: not every device indexes fp8

        def token_fields(d: int) -> dict[str, torch.Tensor]:
            """What every token [T] sends to domain d (views where the wire holds the tensor as it is)."""
            values = {"hidden": payload_rows}
            if fp8:
                values["scales"] = scales
            if routing.form == ROUTING_MAP:
                values["route"] = routing.routing_map[:, d * G:(d + 1) * G]
                if probs is not None:
                    values["probs"] = probs[:, d * G:(d + 1) * G]
            else:  # domain-local ids + 1 on the wire, so that the zeros of unused rows mean "none"
                ids = routing.topk_idx
                values["route"] = torch.where(slot_domain == d, ids - d * G + 1, torch.zeros_like(ids))
                if probs is not None:
                    values["probs"] = probs
            return values

        # The domain backend's form: ranks that differ in an option that changes it (elastic's expand) disagree
        # here, on every rank, not in one domain's handshake after the rail rows moved (or nowhere).
        form = self.domain.dispatch_form(routing.form, **options)
        fingerprint = OpFingerprint(OP_DISPATCH, dtype=data.dtype, probs=probs is not None, form=form,
                                    topk=min(k, TOPK_FIELD_MAX), grad=self.op_records_backward,
                                    probs_grad=self.op_probs_need_grad)
        if self.config.blocking:  # the domain stage of the agreement comes before the segment counts below
            splits, disagreement = self._rail_agreement(fingerprint, packer.row_bytes, where, refused=refused,
                                                        send_counts=[len(tokens) for tokens in send_tokens])
        else:  # no counts to carry the agreement: both stages before any row moves
            self._open(fingerprint, packer.row_bytes, where, refused=refused)
            capacity = self.config.max_tokens_per_rank
            splits, disagreement = RailSplits([capacity] * D, [capacity] * D, capacity), None
        with self._between_exchanges(where):  # (a disagreement raises in _segment_counts, on every rank)
            if disagreement is None:
                payload = self._pack_for_rail(packer, token_fields, to_domain, send_tokens, send_slot)
                # Blocking mode reads the rows' counts on the host next (_segment_counts): waited for here, with
                # the timeout, so that a rail peer that stopped after the count exchange is named.
                received = packer.unpack(self.scaleout.exchange_rows(payload, splits, where=f"{where}: rail/tokens",
                                                                     read_on_host=self.config.blocking))
            else:  # no payload moves on this rail; the domain hears of it in the domain stage below
                splits = RailSplits([0] * D, [0] * D, 0)
                received = packer.unpack(torch.zeros(0, packer.row_bytes, dtype=torch.uint8, device=dev))

            # The domain stage: the received rows, in (source domain, source token) order.
            num_received = sum(splits.recv)
            hidden_in = (received["hidden"], received["scales"]) if fp8 else received["hidden"]
            if routing.form == ROUTING_MAP:
                mask = received["route"]
                routing_in = {"routing_map": mask, "probs": received.get("probs")}
            else:
                ids = received["route"] - 1
                mask = torch.zeros(num_received, G + 1, dtype=torch.bool, device=dev).scatter_(
                    1, torch.where(ids >= 0, ids, torch.full_like(ids, G)), True)[:, :G]
                routing_in = {"topk_idx": ids, "topk_weights": received.get("probs")}
        counts = self._segment_counts(mask, splits, where, fingerprint, disagreement, packer.row_bytes)
        self._num_dispatches = number
        if flagged is not None:  # not before: a dispatch every rank refused must leave check_errors nothing
            previous = self._invalid_expert_ids
            self._invalid_expert_ids = flagged if previous is None else previous | flagged
        with self._between_exchanges(where):
            out = self._at_domain_level(lambda: self.domain.dispatch(hidden_in, pad_multiple=pad_multiple, **routing_in,
                                                                     **options))
            inner: Handle = out.handle
            if inner.output_form == COMPACT:
                dest = flat_order_index(counts[:, :, L:], 1, inner.num_rows)
            else:
                dest = flat_order_index(counts[:, :, :L], pad_multiple, inner.num_rows)

            layout = HierarchicalLayout(dispatch_id=number, domain_handle=inner, to_domain=to_domain,
                                        send_tokens=send_tokens, send_slot=send_slot, splits=splits,
                                        slot_domain=slot_domain, dest=dest,
                                        overflow=getattr(inner.layout, "overflow", None))
            handle = Handle(
                backend=self, num_tokens=T, hidden_size=self.hidden_size, hidden_dtype=inner.hidden_dtype,
                probs_shape=routing.probs_shape if probs is not None else None, num_experts=E, num_local_experts=L,
                pad_multiple=pad_multiple, num_rows=inner.num_rows, tokens_per_expert=inner.tokens_per_expert,
                num_real_tokens_per_expert=inner.num_real_tokens_per_expert, layout=layout, handle_id=number,
                output_form=inner.output_form, row_probs_shape=inner.row_probs_shape)
            rows = tuple(_to_flat(t, dest) for t in out.hidden) if fp8 else _to_flat(out.hidden, dest)
            return DispatchOutput(rows, _to_flat(out.probs, dest), out.tokens_per_expert, handle,
                                  topk_idx=_to_flat(out.topk_idx, dest), num_valid_rows=out.num_valid_rows,
                                  tokens_per_expert_list=out.tokens_per_expert_list, ready=self._ready())

    def _dispatch_again(self, hidden, handle: Handle) -> torch.Tensor:
        layout: HierarchicalLayout = handle.layout
        where = f"dispatch_again along dispatch #{layout.dispatch_id}"
        rows = self._send_along(hidden, None, handle, where,
                                lambda received: self.domain.dispatch_again(received, layout.domain_handle))
        return _to_flat(rows, layout.dest)

    def _cached_dispatch(self, hidden, handle: Handle, **form) -> DispatchOutput:
        """``dispatch(hidden, handle=...)``: no layout, no count exchange; FP8 where the domain backend takes it.
        ``form``: expand / zero_padding, checked against the handle before the rails move anything."""
        data = self.check_cached_input(hidden, handle)
        fp8 = isinstance(hidden, (tuple, list))
        layout: HierarchicalLayout = handle.layout
        where = f"cached dispatch along dispatch #{layout.dispatch_id}"
        if form:
            self.domain.check_cached_form(layout.domain_handle, **form)

        out = self._send_along(data, hidden[1] if fp8 else None, handle, where,
                               lambda received: self.domain.dispatch(received, handle=layout.domain_handle, **form))
        rows = tuple(_to_flat(t, layout.dest) for t in out.hidden) if fp8 else _to_flat(out.hidden, layout.dest)
        return DispatchOutput(rows, None, handle.tokens_per_expert, handle, num_valid_rows=out.num_valid_rows,
                              ready=self._ready())

    def _combine(self, rows, handle: Handle, row_probs, bias=None) -> CombineOutput:
        self.check_usable()
        layout: HierarchicalLayout = handle.layout
        where = f"combine of dispatch #{layout.dispatch_id}"
        T, H = handle.num_tokens, self.hidden_size
        fingerprint = OpFingerprint(OP_COMBINE, dtype=rows.dtype, probs=row_probs is not None,
                                    handle_id=layout.dispatch_id, grad=self.op_records_backward)
        # The rail rows' width, as this rank will pack them: ranks whose probs dtypes differ would
        # otherwise meet in an exchange of two sizes.
        probs_dtype = None if row_probs is None else row_probs.dtype
        width = _combine_packer(rows.dtype, probs_dtype, layout.domain_handle.probs_shape, H).row_bytes
        self._open(fingerprint, width, where, send_counts=layout.splits.recv, expected=layout.splits.send)
        with self._between_exchanges(where):
            inner_probs = row_probs.index_select(0, layout.dest) if row_probs is not None else None
            partial = self._at_domain_level(lambda: self.domain.combine(rows.index_select(0, layout.dest),
                                                                        layout.domain_handle, row_probs=inner_probs))
            packer = _combine_packer(partial.hidden.dtype, None if partial.probs is None else partial.probs.dtype,
                                     None if partial.probs is None else partial.probs.shape, H)
            payload = packer.pack_into(self.scaleout.send_rows(partial.hidden.shape[0], packer.row_bytes),
                                       {"hidden": partial.hidden, "probs": partial.probs})
            # Views of the received rows (no copy): they are read below, before any other rail exchange.
            back = packer.unpack(self.scaleout.exchange_rows(payload, layout.splits.reversed(),
                                                             where=f"{where}: rail/rows"), copy=False)

            accumulate = torch.float64 if rows.dtype == torch.float64 else torch.float32
            summed, probs = self._add_returned(back, layout, T, accumulate, handle.probs_shape)
            if bias is not None:
                summed += bias.to(accumulate)
            return CombineOutput(summed.to(rows.dtype), probs)

    # ---- stages -------------------------------------------------------------------------------

    def _rail_layout(self, to_domain: torch.Tensor):
        """Blocking: the tokens each domain gets (host-sized index lists). Sync-free: each (token, domain)'s
        row in that domain's fixed block (device only)."""
        if self.config.blocking:
            return [to_domain[:, d].nonzero().view(-1) for d in range(self.num_domains)], None
        return None, torch.cumsum(to_domain.to(torch.int64), 0) - 1

    def _pack_for_rail(self, packer: RowPacker, token_fields: Callable, to_domain: torch.Tensor,
                       send_tokens: Optional[list], send_slot: Optional[torch.Tensor]) -> torch.Tensor:
        """The rail payload: per domain, the rows of the tokens it gets (blocking: exactly those; sync-free:
        a block of max_tokens_per_rank rows, unused rows zero, i.e. routed nowhere), packed in place into
        the rail's send rows (``ScaleOut.send_rows``)."""
        D = self.num_domains
        if send_tokens is not None:
            payload = self.scaleout.send_rows(sum(len(tokens) for tokens in send_tokens), packer.row_bytes)
            start = 0
            for d, tokens in enumerate(send_tokens):
                packer.pack_into(payload[start:start + len(tokens)], token_fields(d), take=tokens)
                start += len(tokens)
            return payload
        capacity = self.config.max_tokens_per_rank
        spill = D * capacity  # one row past the blocks for the tokens a domain does not get (not sent)
        payload = self.scaleout.send_rows(spill + 1, packer.row_bytes).zero_()
        for d in range(D):
            target = torch.where(to_domain[:, d], d * capacity + send_slot[:, d],
                                 torch.full_like(send_slot[:, d], spill))
            packer.pack_into(payload, token_fields(d), at=target)
        return payload[:spill]

    def _add_returned(self, back: dict[str, torch.Tensor], layout: HierarchicalLayout, T: int,
                      accumulate: torch.dtype, probs_shape) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Combine at the source: each domain's returned partial added in ``accumulate`` in domain order
        ([T, H]), and its probs put back in the columns or slots of that domain (or None)."""
        G, H = self.experts_per_domain, self.hidden_size
        device = back["hidden"].device
        summed = torch.zeros(T, H, dtype=accumulate, device=device)
        converted = torch.empty(T, H, dtype=accumulate, device=device)  # a domain's rows, widened
        probs = None
        if "probs" in back:
            probs = back["probs"].new_zeros(probs_shape)
        for d, tokens, source_rows, valid in self._returned_rows(layout, T):
            part = converted[:tokens.shape[0]].copy_(back["hidden"][source_rows])
            if valid is not None:
                part.masked_fill_(~valid.unsqueeze(1), 0)
            summed.index_add_(0, tokens, part)
            if probs is None:
                continue
            values = back["probs"][source_rows]
            if layout.slot_domain is None:  # routing map: this domain's G columns
                mine = probs[tokens, d * G:(d + 1) * G]
                keep = valid.unsqueeze(1) if valid is not None else torch.ones_like(mine, dtype=torch.bool)
                probs[tokens, d * G:(d + 1) * G] = torch.where(keep, values, mine)
            else:  # top-k: the slots whose expert lives in this domain
                keep = layout.slot_domain[tokens] == d
                if valid is not None:
                    keep &= valid.unsqueeze(1)
                probs[tokens] = torch.where(keep, values, probs[tokens])
        return summed, probs

    def _returned_rows(self, layout: HierarchicalLayout, T: int):
        """Per domain: (domain, source tokens, their rows in the returned payload (a slice or an index), valid
        mask or None)."""
        dev = layout.to_domain.device
        if layout.send_tokens is not None:
            start = 0
            for d, tokens in enumerate(layout.send_tokens):
                yield d, tokens, slice(start, start + len(tokens)), None
                start += len(tokens)
            return
        capacity = self.config.max_tokens_per_rank
        every = torch.arange(T, device=dev)
        for d in range(self.num_domains):
            yield d, every, d * capacity + layout.send_slot[:, d].clamp(min=0), layout.to_domain[:, d]

    def _send_along(self, data: torch.Tensor, scales: Optional[torch.Tensor], handle: Handle, where: str,
                    forward: Callable):
        """Rail stage of a dispatch along an existing layout (dispatch_again, cached dispatch), then
        ``forward(received hidden)`` at the domain level."""
        self.check_usable()
        layout: HierarchicalLayout = handle.layout
        fields = [("hidden", data.dtype, (self.hidden_size,))]
        if scales is not None:
            fields.append(("scales", torch.float32, (self.hidden_size // self.FP8_BLOCK,)))
        packer = RowPacker(fields)
        payload_rows = data.view(torch.uint8) if scales is not None else data  # fp8 indexed as bytes
        # grad: a cached dispatch through ep_plugin.dispatch may be recorded (a backward's dispatch_again never is)
        fingerprint = OpFingerprint(OP_DISPATCH_AGAIN, dtype=data.dtype, handle_id=layout.dispatch_id,
                                    grad=self.op_records_backward)
        self._open(fingerprint, packer.row_bytes, where, send_counts=layout.splits.send, expected=layout.splits.recv)
        with self._between_exchanges(where):

            def token_fields(d: int) -> dict[str, torch.Tensor]:
                return {"hidden": payload_rows, **({"scales": scales} if scales is not None else {})}

            payload = self._pack_for_rail(packer, token_fields, layout.to_domain, layout.send_tokens, layout.send_slot)
            received = packer.unpack(self.scaleout.exchange_rows(payload, layout.splits, where=f"{where}: rail/tokens"))
            hidden_in = (received["hidden"], received["scales"]) if scales is not None else received["hidden"]
            return self._at_domain_level(lambda: forward(hidden_in))

    def _segment_counts(self, mask: torch.Tensor, splits: RailSplits, where: str, fingerprint: OpFingerprint,
                        disagreement: Optional[str], row_bytes: int) -> torch.Tensor:
        """[S, D, L + 1]: per forwarding peer s and source domain d, the rows it delivers to this rank per
        local expert, and (last) its packets (tokens with any expert here): the reorder's block sizes.

        Blocking mode sends them right after the domain stage of the dispatch's agreement (``_domain_agreement``:
        raises EPError when ranks disagree). Sync-free mode agreed before the rows moved; its counts stay on
        the device (no host read).
        """
        S, D, L = self.domain_size, self.num_domains, self.num_local_experts
        dev = mask.device
        # After the rail exchange, before the domain's: a failure of this rank's own here leaves its peers in
        # the domain stage (the exchange's refusals, raised on every rank alike, stay outside).
        with self._between_exchanges(where):
            mine = self._local_segment_counts(mask, splits)
            if self.config.blocking:  # where the domain words go (the host, mostly): a copy that fails fails here
                mine = mine.to(self._domain_words.word_device)
        if self.config.blocking:
            received = self._domain_agreement(fingerprint, disagreement, where, row_bytes, counts=mine)
        else:
            words = [D * (L + 1)] * S
            received = self._at_domain_level(lambda: self._domain_counts.all_to_all(
                mine.reshape(-1).to(self._domain_counts_device(dev)), words, words,
                where=f"{where}: domain/segment counts", read_on_host=False))
        return received.to(dev).reshape(S, D, L + 1)

    def _local_segment_counts(self, mask: torch.Tensor, splits: RailSplits) -> torch.Tensor:
        """[S, D * (L + 1)]: this rank's part of ``_segment_counts``, from the rows its rail delivered."""
        S, D, L = self.domain_size, self.num_domains, self.num_local_experts
        dev = mask.device
        num_received = mask.shape[0]
        if self.config.blocking:
            source_domain = torch.repeat_interleave(torch.arange(D, device=dev),
                                                    torch.tensor(splits.recv, device=dev), output_size=num_received)
        else:
            source_domain = torch.div(torch.arange(num_received, device=dev), self.config.max_tokens_per_rank,
                                      rounding_mode="floor")
        per_expert = torch.zeros(D, S * L, dtype=torch.int64, device=dev).index_add_(0, source_domain,
                                                                                      mask.to(torch.int64))
        per_peer = torch.zeros(D, S, dtype=torch.int64, device=dev).index_add_(
            0, source_domain, mask.view(num_received, S, L).any(2).to(torch.int64))
        return torch.cat([per_expert.view(D, S, L), per_peer.unsqueeze(2)], 2).permute(1, 0, 2).reshape(S, -1)

    def _domain_counts_device(self, device: torch.device) -> torch.device:
        """Where tensors for ``_domain_counts`` go: the GPU over NCCL alone, else host memory (gloo)."""
        on_gpu = device.type == "cuda" and not moves_host_memory(self._domain_counts.engine)
        return device if on_gpu else torch.device("cpu")

    def _between_exchanges(self, where: str):
        """``host_collectives.between_exchanges`` over the rail's and the domain's collectives."""
        return between_exchanges(where, (self.scaleout.rail, self.scaleout.rail_words, self._domain_counts,
                                         self._domain_words))

    def _open(self, fingerprint: OpFingerprint, row_bytes: int, where: str, *,
              send_counts: Optional[list[int]] = None, expected: Optional[list[int]] = None,
              refused: Optional[RefusedInput] = None) -> Optional[RailSplits]:
        """The agreement every op opens with, before any payload moves: its rail stage, then its domain stage.
        (Blocking dispatch runs the same two stages around its rail payload: its domain stage is followed by the
        segment counts.) Raises EPError on every rank when ranks disagree (ValueError when a rank refused
        its input, ``refused``); returns blocking mode's rail splits, None in sync-free mode."""
        splits, disagreement = self._rail_agreement(fingerprint, row_bytes, where, send_counts=send_counts,
                                                    expected=expected, refused=refused)
        self._domain_agreement(fingerprint, disagreement, where, row_bytes)
        return splits

    def _rail_agreement(self, fingerprint: OpFingerprint, row_bytes: int, where: str, *,
                        send_counts: Optional[list[int]] = None, expected: Optional[list[int]] = None,
                        refused: Optional[RefusedInput] = None) -> tuple[Optional[RailSplits], Optional[str]]:
        """The rail stage: every rank of the rail sends every peer the op fingerprint, the width of its
        rail rows, the backend's number on its group (ranks that use two backends in two orders differ there
        first) and whether it refused its input (``_REFUSED_INPUT`` / ``_REFUSED_TOKENS``, else 0: ``refused``
        says why). Disagreements come before refusals, as in the flat reference's opening exchange;
        blocking mode in its count exchange (``send_counts``; ``expected``: the counts the handle expects
        from the peers), sync-free mode on the host in the same row layout with zero counts (so the two modes'
        backends send rows of one size).

        Returns (blocking mode's splits or None, None), or (..., what the rail peers disagree on: a
        ``RefusedInput`` when a rank refused its input); every rank of the rail sees the same words, so every
        one of them finds the disagreement. No payload has moved.
        """
        refused_code = (0 if refused is None else _REFUSED_TOKENS if isinstance(refused, RefusedTokens)
                        else _REFUSED_INPUT)
        mine = (fingerprint.pack(), row_bytes, self._host.instance, refused_code)
        if self.config.blocking:
            splits, theirs = self.scaleout.exchange_counts(send_counts, mine, where=f"{where}: rail/counts")
        else:  # in the row blocking mode sends (count, words, counts): one size for both modes' backends
            row = torch.tensor([0, *mine] + [0] * self.num_domains)
            rows = self.scaleout.exchange_words(row, where=f"{where}: rail/agreement")
            splits, theirs = None, [tuple(words[1:1 + len(mine)]) for words in rows]
        rail_ranks = self._topology.rail_ranks()  # the peers' ranks in the EP group, by domain
        for peer, words in enumerate(theirs):  # first: the other words mean nothing across two backends
            if words[2] != mine[2]:
                return splits, (self._other_backend_message(where, rail_ranks[peer], words[2]) +
                                f" (seen on {self.scaleout.level})")
        for peer, words in enumerate(theirs):
            if words[0] != mine[0]:
                mismatch = mismatch_message(self.name, self.rank, rail_ranks[peer], mine[0], words[0],
                                            self._host.peer_name)
                return splits, f"{mismatch} (seen on {self.scaleout.level} in {where})"
        for peer, words in enumerate(theirs):
            if words[1] != mine[1]:
                return splits, (f"ep_plugin {self.name}: ranks disagree on {where} ({self.scaleout.level}): row bytes "
                                f"{mine[1]} on rank {self.rank}, {words[1]} on rank {rail_ranks[peer]}")
        # Tokens alone only where no rank of the rail refused for another reason (the same on every rank).
        refused_why = RefusedInput if _REFUSED_INPUT in [mine[3]] + [words[3] for words in theirs] else RefusedTokens
        if refused is not None:  # worded as a flat backend's (``CompiledBackend._raise_refused``)
            return splits, refused_why(f"{refused} (on rank {self.rank}); every rank of backend {self.name!r} refused "
                                       f"this dispatch; the backend stays usable")
        refusing = [rail_ranks[peer] for peer, words in enumerate(theirs) if words[3]]
        if refusing:
            seen = f"seen on {self.scaleout.level}"
            why = (f"passed {self._too_many_tokens()} in {where} ({seen})" if refused_why is RefusedTokens
                   else f"refused their {where} input (their errors say why; {seen})")
            return splits, refused_why(f"ep_plugin {self.name}: rank(s) {refusing} of the group {why}; every rank "
                                        f"refuses it, and the backend stays usable")
        if expected is not None and splits is not None and splits.recv != expected:
            return splits, (f"ep_plugin {self.name}: {self.scaleout.level}: in {where} the rail peers announce "
                            f"{splits.recv} rows, the handle expects {expected}; the ranks' handles come from "
                            f"different dispatches.")
        return splits, None

    def _other_backend_message(self, where: str, peer_rank: int, peer_number: int) -> str:
        """Ranks ran an op on two backends: this one and the ``peer_number``-th built on the group."""
        return (f"ep_plugin {self.name}: ranks disagree on {where}: rank {self.rank} ran it on the backend built "
                f"{ordinal(self._host.instance)} on this process group, rank {peer_rank} on the one built "
                f"{ordinal(peer_number)}. Ranks must use their backends in the same order.")

    def _domain_agreement(self, fingerprint: OpFingerprint, disagreement: Optional[str], where: str,
                          row_bytes: int, *, counts: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The domain stage: every rank of the domain sends every peer whether its rail found ranks that
        disagree (``disagreement``), its op fingerprint, the backend's number on its group and the width of
        its rail rows (``row_bytes``: the probs dtype is in it, not in the fingerprint; a rail only compares
        its own ranks' widths, and ranks whose widths differ by local index would meet in the domain backend's
        own check, after the rail rows moved). Raises EPError on every rank of the domain when a rail flagged
        or two fingerprints, numbers or widths differ.

        Why that reaches every rank of every domain: a rail whose ranks disagree flags on all of them, and a
        rail has a rank in every domain; where every rail agrees, a rank's fingerprint depends on its local
        index alone, and every domain holds every local index, so if not all are equal every domain sees two.

        The four words are one frame (``FRAME_WORDS`` per peer, the fingerprint second), the size of every host
        call's first exchange on a group: the domain backend's setup calls share the group (or its gloo twin),
        and a rank in one of them (a destroy, say) while a peer runs an op meets it in one size and raises
        EPError, where gloo would abort on two. CPU tensors where the group moves them (``_domain_words``).
        Blocking dispatch then sends its segment counts ``counts`` [S, D * (L + 1)] in a second exchange of
        one size, every rank of the domain being in the same op of the same backend; returns the peers'
        counts (a host read), None for the other ops and in sync-free mode.
        """
        S, code, instance = self.domain_size, fingerprint.pack(), self._host.instance
        # The flag: 0 agreed, 1 ranks disagree, 2 a rank refused its input (RefusedInput), 3 for its token count
        # alone (RefusedTokens).
        flag = (0 if disagreement is None else 3 if isinstance(disagreement, RefusedTokens)
                else 2 if isinstance(disagreement, RefusedInput) else 1)
        phase = "domain/segment counts" if counts is not None else "domain/agreement"
        collectives = self._domain_words
        device = collectives.word_device
        sent = torch.tensor([[flag, code, instance, row_bytes]] * S, dtype=torch.int64, device=device)
        frames = [FRAME_WORDS] * S
        theirs = self._at_domain_level(lambda: collectives.all_to_all(
            sent.reshape(-1), frames, frames, where=f"{where}: {phase}", read_on_host=True)).view(S, -1).tolist()
        differs = (disagreement is not None and not isinstance(disagreement, RefusedInput)) or any(
            flag == 1 or word != code or number != instance or width_of_peer != row_bytes
            for flag, word, number, width_of_peer in theirs)
        late = differs and self._came_late_error(f"{where}: {phase}")
        if late:  # a peer gave up waiting for this rank: what differs is the call it left behind
            raise late
        domain_ranks = self._topology.domain_ranks()  # (peer is an index in the domain)
        in_setup = [peer for peer, (_, word, _, _) in enumerate(theirs) if word == SETUP_EXCHANGE]
        if in_setup:  # a domain peer building or destroying a backend on this group met this op: one frame size
            raise met_a_setup_step_error(self.name, self._host.peer_name(self.rank), where,
                                         [self._host.peer_name(domain_ranks[peer]) for peer in in_setup],
                                         self.domain_level)
        # First: ranks that ran this op on two backends (each rail on one of its own) raise EPError on every rank
        # here, before any rail's refusal could make some of them raise TooManyTokensError alone.
        for peer, (_, _, number, _) in enumerate(theirs):
            if number != instance:
                raise EPError(f"{self._other_backend_message(where, self._topology.domain_ranks()[peer], number)} "
                              f"(seen in {self.domain_level})")
        # Disagreements before refusals, as flat: a domain holds a rank of every rail, so every rank of the group
        # sees a rail that found ranks disagreeing, whatever another rail refused.
        if disagreement is not None and not isinstance(disagreement, RefusedInput):
            raise EPError(str(disagreement))
        # Named as the EP group knows them, like every other message.
        flagged = [peer for peer, (flag, *_) in enumerate(theirs) if flag == 1]
        if flagged:
            names = ", ".join(self._host.peer_name(domain_ranks[peer]) for peer in flagged)
            raise EPError(f"ep_plugin {self.name}: {self.domain_level}: in {where} the rail of {names} found that "
                          f"ranks disagree on the op (their errors say how); every rank of this domain stops here. "
                          f"{WHAT_RANKS_SHARE}")
        for peer, (_, word, _, _) in enumerate(theirs):
            if word != code:
                mismatch = mismatch_message(self.name, self.rank, domain_ranks[peer], code, word, self._host.peer_name)
                raise EPError(f"{mismatch} (seen in {self.domain_level} in {where})")
        for peer, (_, _, _, width_of_peer) in enumerate(theirs):  # the same op everywhere: its rows' width
            peer_rank = domain_ranks[peer]
            if width_of_peer != row_bytes:
                raise EPError(f"ep_plugin {self.name}: ranks disagree on {where}: rail rows of {row_bytes} bytes on "
                              f"rank {self.rank}, {width_of_peer} on rank {peer_rank} (the probs' dtypes differ, or "
                              f"the payload's; seen in {self.domain_level}). {WHAT_RANKS_SHARE}")
        # Every rank agrees on the op; every rank sees every rail's refusal here. Where each rail either agreed
        # or refused token counts alone, every rank raises TooManyTokensError.
        refused_error = TooManyTokensError if {flag for flag, *_ in theirs} <= {0, 3} else ValueError
        if disagreement is not None:
            raise refused_error(str(disagreement))
        refusing = [peer for peer, (flag, *_) in enumerate(theirs) if flag in (2, 3)]
        if refusing:
            names = ", ".join(self._host.peer_name(domain_ranks[peer]) for peer in refusing)
            why = (f"passed {self._too_many_tokens()}" if refused_error is TooManyTokensError
                   else "refused its input (its error says why)")
            raise refused_error(f"ep_plugin {self.name}: {self.domain_level}: in {where} the rail of {names} found a "
                                f"rank that {why}; every rank refuses it, and the backend stays usable")
        if counts is None:
            return None
        words = [counts.shape[1]] * S  # the same on every rank of the domain: one backend (agreed above)
        return self._at_domain_level(lambda: collectives.all_to_all(
            counts.reshape(-1).to(device), words, words, where=f"{where}: {phase} (after the agreement)",
            read_on_host=True)).view(S, -1)

    def _came_late_error(self, where: str) -> Optional[EPError]:
        """``HostCollectives.came_late_error`` over every collective of this backend's stages: a rail or domain
        peer that timed out waiting for this rank left an exchange that this rank's next call met. Ranks are
        named as the EP group knows them, like every other message (a rail's or a domain's index is not)."""
        rails = (self.scaleout.rail, self.scaleout.rail_words)

        def name_peer(owner: HostCollectives, q: int) -> str:
            ranks = self._topology.rail_ranks() if owner in rails else self._topology.domain_ranks()
            return self._host.peer_name(ranks[q])

        return rails[0].came_late_error(where, (rails[1], self._domain_counts, self._domain_words),
                                        name_peer=name_peer,
                                        this_rank=f"ep_plugin {self.name}: {self._host.peer_name(self.rank)}")

    def _at_domain_level(self, call: Callable):
        """Run a domain-level step; its errors come back naming the domain."""
        try:
            return call()
        except EPError as exc:
            raise type(exc)(f"{getattr(self, 'domain_level', 'domain')}: {exc}") from None

    # ---- byte model (for benchmarks) ------------------------------------------------------------

    def scaleout_bytes(self, routing_maps: list[torch.Tensor], *, row_bytes: int, with_probs: bool,
                       topk: int = 0) -> dict:
        """Bytes each rank sends over its rail (host arithmetic on every rank's [T, E] routing map).

        Returns {"dispatch": [per rank], "combine": [per rank]}: dispatch sends a token once per other
        domain holding any of its experts (row + routing columns + probs), combine returns one row per
        such (token, domain). Bytes to this rank's own domain stay in the domain and are not counted.
        ``topk``: the dispatch's top-k width where it passes top-k ids (0: a routing map). Sync-free mode
        moves fixed blocks of ``max_tokens_per_rank`` rows per other domain instead of the exact rows.
        """
        return scaleout_bytes(routing_maps, self._topology, row_bytes=row_bytes, hidden=self.hidden_size,
                              with_probs=with_probs, topk=topk,
                              block_rows=None if self.config.blocking else self.config.max_tokens_per_rank)


def _combine_packer(hidden_dtype: torch.dtype, probs_dtype: Optional[torch.dtype], probs_shape,
                    hidden: int) -> RowPacker:
    """The combine's rail rows: each token's partial sum, then its probs (when they travel back)."""
    fields = [("hidden", hidden_dtype, (hidden,))]
    if probs_dtype is not None:
        fields.append(("probs", probs_dtype, tuple(probs_shape[1:])))
    return RowPacker(fields)


def scaleout_bytes(routing_maps: list[torch.Tensor], topology: Topology, *, row_bytes: int, hidden: int,
                   with_probs: bool, topk: int = 0, block_rows: Optional[int] = None) -> dict[str, list[int]]:
    """See ``HierarchicalBackend.scaleout_bytes``. The routing travels as the domain's routing-map columns
    (bool, then fp32 probs: G + 4G bytes a row), or with ``topk`` > 0 as the token's k ids and weights
    (int64 and fp32: 12k bytes). ``block_rows``: sync-free mode's fixed rows per other domain (its
    ``max_tokens_per_rank``), sent whatever the routing; None: blocking mode's exact rows."""
    D = topology.num_domains
    totals = {"dispatch": [0] * topology.world_size, "combine": [0] * topology.world_size}
    for source, routing_map in enumerate(routing_maps):
        G = routing_map.shape[1] // D
        own = source // topology.domain_size
        if block_rows is not None:
            remote = block_rows * (D - 1)
        else:
            per_domain = routing_map.view(routing_map.shape[0], D, G).any(2).sum(0).tolist()
            remote = sum(count for d, count in enumerate(per_domain) if d != own)
        route, probs = (8 * topk, 4 * topk) if topk else (G, 4 * G)
        totals["dispatch"][source] = remote * (row_bytes + route + (probs if with_probs else 0))
        totals["combine"][source] = remote * (2 * hidden + (probs if with_probs else 0))
    return totals


def _to_flat(rows: Optional[torch.Tensor], dest: torch.Tensor) -> Optional[torch.Tensor]:
    """``flat[dest[i]] = rows[i]`` (dest is a permutation of the rows); FP8 is moved as bytes."""
    if rows is None:
        return None
    if rows.dtype == torch.float8_e4m3fn:
        return _to_flat(rows.view(torch.uint8), dest).view(rows.dtype)
    flat = torch.empty_like(rows)
    flat[dest] = rows
    return flat
