"""What the compiled backends (``hybrid``, ``elastic``) share: the GPU checks, the symmetric buffer
on the transport, the co-residency refusal, the stream policy, op fingerprints, error reports,
the barrier and teardown. Each backend adds its own regions and stages.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Iterable, Optional

import torch

from .. import _cuda, streams
from ..agreement import OP_BARRIER, fingerprint_code
from ..config import MAX_PAD_MULTIPLE
from ..errors import BackendUnavailableError, EPError, EPTimeoutError, TooManyTokensError
from ..routing import ROUTING_MAP, Routing, check_topk_values, dropped_ids_error
from ..transport.fabric import gpu_link_bandwidths
from ..transport.placement import ranks_per_gpu
from ..transport.sizing import co_residency_limit, mps_thread_percentage, resolve_num_sms
from ..transport.symmetric import SymmetricBuffer
from .base import Backend

INT32_MAX = (1 << 31) - 1  # the kernels' row and packet indices are int32
# csrc/include/ep/limits.h's kMaxLocalExperts (the extension's MAX_LOCAL_EXPERTS; test_extension checks they
# agree), here so that a layer's shape is checked where the extension is not loaded (Megatron's model build).
MAX_LOCAL_EXPERTS = 256


def worst_case_rows(num_ranks: int, max_tokens_per_rank: int, num_local_experts: int, experts_per_token: int,
                    pad_multiple: int = 1) -> int:
    """Rows of the largest expert-row dispatch output a rank can receive: every rank's every token on
    ``experts_per_token`` of this rank's experts (top-k, at most the local experts), plus padding."""
    per_token = min(experts_per_token, num_local_experts)
    return num_ranks * max_tokens_per_rank * per_token + num_local_experts * (pad_multiple - 1)


def co_residency_problem(num_blocks: int, sharing: int, sms: int, percentage: Optional[float]) -> Optional[str]:
    """Why ``num_blocks`` spin-waiting blocks per rank, for ``sharing`` ranks on a GPU that offers ``sms`` SMs
    (each MPS client at most ``percentage`` of them, None: no share set), cannot all be resident at once, with
    the fix; None when they can."""
    limit = co_residency_limit(sms, sharing, percentage)
    if num_blocks <= limit:
        return None
    mps = "" if percentage is None else (f", of which CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage:g} lets "
                                         f"each rank use {int(sms * min(percentage, 100.0) / 100.0)}")
    fix = (f"Lower EP_PLUGIN_NUM_SMS to <= {limit}" if limit >= 1 else
           "Not one block per rank fits: run fewer ranks per GPU" + (" or raise the percentage" if mps else ""))
    return (f"{sharing} rank(s) share one GPU and each runs {num_blocks} spin-waiting blocks (num_sms), "
            f"{sharing * num_blocks} in all, but the GPU offers {sms} SMs{mps}; all must be resident at once or "
            f"the kernels deadlock. {fix}.")


def row_index_problem(name: str, num_ranks: int, max_tokens_per_rank: int, num_local_experts: int,
                      experts_per_token: int) -> Optional[str]:
    """Why these sizes could send one rank more rows than the kernels' 32-bit indices hold, or None. Past 2^31
    an expert's segment start wraps negative and its padding is written far outside the output."""
    worst_rows = worst_case_rows(num_ranks, max_tokens_per_rank, num_local_experts, experts_per_token,
                                 MAX_PAD_MULTIPLE)
    if worst_rows <= INT32_MAX:
        return None
    per_token = min(experts_per_token, num_local_experts)
    return (f"backend {name!r}: {num_ranks} ranks x max_tokens_per_rank={max_tokens_per_rank} can send one rank "
            f"{worst_rows} rows ({per_token} of its experts per token, and the largest padding), past the kernels' "
            f"32-bit row indices ({INT32_MAX}); lower max_tokens_per_rank (EP_PLUGIN_MAX_TOKENS_PER_RANK)")

try:  # the `nvtx` package when installed, else torch's bindings
    import nvtx as _nvtx

    def nvtx_range(name: str):
        return _nvtx.annotate(name, domain="ep_plugin")
except ImportError:  # pragma: no cover - depends on the environment

    class nvtx_range:  # noqa: N801 - used like the function above
        """torch's push/pop: 0.7 µs a range where torch.cuda.nvtx.range (a generator) costs 1.5 µs (H200 host)."""

        __slots__ = ("name",)

        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            torch.cuda.nvtx.range_push(self.name)

        def __exit__(self, *exc) -> None:
            torch.cuda.nvtx.range_pop()


def op_range(op: str):
    """Decorate a compiled backend's op: one NVTX range, ``ep.<backend>.<op>``, around the whole op.

    One per op, not one per stage: an op is one to three launches whose kernels a profile names
    anyway, and each range costs ~1.5 µs of the host time that paces eager decode. Host waits
    inside an op (blocking mode's count read) keep a range of their own.

    Also: an op that fails on this rank alone after its first launch (an allocation only its count could
    size, say) has taken its place in the device handshakes, and its peers ran it: the backend is out of
    step, and says so then and at every later op (``EPError``), where a retry would have met the peers'
    next op. So is a host wait of the op that timed out before the device reported anything (its kernels
    are still queued). Bad input refused before the first launch, the refusals every rank raises alike at the
    count read (``_dispatch_counts``) and the device's own reports (``EPError``) are not that; a ValueError or
    TypeError of this rank alone after a launch (a launcher refusing an argument the Python checks let by: a
    bug) is. A KeyboardInterrupt or SystemExit there leaves the backend out of step too, but propagates as
    itself (a handler that saves a checkpoint on Ctrl-C must see it)."""
    def decorate(method):
        names: dict[str, str] = {}  # backend name -> range name, built once

        @functools.wraps(method)
        def ranged(self, *args, **kwargs):
            name = names.get(self.name)
            if name is None:
                name = names[self.name] = f"ep.{self.name}.{op}"
            if self._failed_mid_op is not None:
                raise self._out_of_step_error(f"{op} refused: an earlier")
            launches = self._launches
            with nvtx_range(name):
                try:
                    return method(self, *args, **kwargs)
                except EPTimeoutError as exc:
                    # A host wait that gave up before the device reported anything (the stream is stuck behind
                    # other work): the op's kernels stay queued and will take their place in the handshakes.
                    if self._launches != launches and self.buffer.failure_message() is None:
                        self._failed_mid_op = f"{op} timed out on the host after its first launch ({exc})"
                    raise
                except EPError:
                    raise
                except BaseException as exc:
                    # Nothing enqueued, or only captured into a graph (no kernel ran, no handshake took
                    # place), or refused by every rank: the call may be made again.
                    if (self._launches == launches or torch.cuda.is_current_stream_capturing()
                            or getattr(exc, "raised_by_every_rank", False)):
                        raise
                    self._failed_mid_op = f"{op} failed after its first launch ({type(exc).__name__}: {exc})"
                    if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: kept as they are, for their handlers
                        raise
                    raise self._out_of_step_error("this") from exc
        return ranged
    return decorate


class CompiledBackend(Backend):
    """A backend whose kernels run over a ``SymmetricBuffer`` (ranks may share a GPU or not)."""

    # Phase number -> name in timeout reports; the barrier's phase number.
    phase_names: dict[int, str] = {}
    barrier_phase: int = 0
    # Experts per token assumed when num_sms = 0 sizes the grid before any dispatch is seen.
    autosize_topk: int = 8
    # Peers' buffers are opened with CUDA IPC: one NVLink domain at most (more go hierarchical).
    needs_shared_memory = True
    # The layout kernel flags bad top-k ids and the count exchange tells every rank (_dispatch_counts).
    checks_ids_on_device = True
    # A combine with row_probs gathers the values routed back by the caller's top-k ids (layout.topk_idx).
    combine_reads_topk_ids = True
    # The counts a dispatch hands out are views of its scratch, which its cached dispatch and combine's backward
    # read again (no copy per dispatch): a change in place since is refused.
    kernels_read_handed_out_counts = True
    # Per-SM copy rates (GB/s) of this backend's kernels, for num_sms = 0: measured on the H200 bed
    # (benchmarks/NOTES.md), far below DeepEP's rule (sizing.SM_READ/WRITE_GBYTES_PER_S), which
    # would size our grids several times too small.
    sm_read_gbytes_per_s: float = 20.0
    sm_write_gbytes_per_s: float = 20.0
    # op_range's state (set per instance in __init__; here too, for an op reached before that finished)
    _launches: int = 0
    keep_buffer_memory: bool = False  # destroy() leaves the buffer allocated (hybrid: an arena tensor lives on)
    _failed_mid_op: Optional[str] = None

    @classmethod
    def shape_problem(cls, hidden_size: int, num_local_experts: int) -> Optional[str]:
        if num_local_experts > MAX_LOCAL_EXPERTS:
            return f"backend {cls.name!r} supports at most {MAX_LOCAL_EXPERTS} local experts, got {num_local_experts}"
        if hidden_size % 8:
            return f"backend {cls.name!r} needs hidden_size divisible by 8 (16-byte rows), got {hidden_size}"
        return None

    def experts_per_token_limit(self) -> int:
        """The most of one rank's experts a token can reach: all of them in the routing-map form (hybrid);
        backends that take top-k ids say their widest k."""
        return self.num_local_experts

    def __init__(self, group=None, *, hidden_size, num_experts, config=None, device=None, topology=None) -> None:
        super().__init__(group, hidden_size=hidden_size, num_experts=num_experts, config=config, device=device,
                         topology=topology)
        # First, as no GPU could serve it either (row_index_problem).
        problem = row_index_problem(self.name, self.num_ranks, self.config.max_tokens_per_rank,
                                    self.num_local_experts, self.experts_per_token_limit())
        if problem:
            raise ValueError(problem)
        problem = self.shape_problem(hidden_size, self.num_local_experts)
        if problem:
            raise ValueError(problem)
        if not _cuda.available():
            raise BackendUnavailableError(
                f"backend {self.name!r} needs the CUDA extension and a GPU: {_cuda.describe()}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        problem = _cuda.arch_problem(torch.cuda.get_device_capability(self.device))
        if problem:  # before the buffer's exchange: every rank of a job has such GPUs, so every rank raises
            raise BackendUnavailableError(f"backend {self.name!r}: {problem}")
        self._C = _cuda.extension()
        if self.num_ranks > self._C.MAX_RANKS:
            raise ValueError(f"backend {self.name!r} supports at most {self._C.MAX_RANKS} ranks per NVLink domain, "
                             f"got {self.num_ranks}")
        # The setup's host exchanges run on the base's timed collectives (self._host): a rank that failed
        # alone, say out of memory, makes the others raise naming it instead of waiting out the group's own timeout.
        sharing = ranks_per_gpu(self._host, self.device)
        self.num_blocks = self._resolve_num_blocks(sharing)
        self._check_co_residency(sharing)
        self._bulk = bool(self.config.bulk_copy)  # the kernels fall back to register copies below sm_90
        self._dispatch_count = 0  # handle ids: the n-th dispatch of this backend makes handle n
        # Non-blocking mode: the input flags of every top-k dispatch since check_errors() last raised for
        # them, ORed on the device by the layout kernel ([1] int32, see _layout): ids out of range were
        # dropped, not indexed, and check_errors() reports them. One word, so that a later clean dispatch
        # cannot hide an earlier one's (as the last dispatch's flags alone did).
        with torch.inference_mode(False):  # built under inference mode, check_errors() still resets it outside
            self._flags_since_checked = (None if self.config.blocking else
                                         torch.zeros(1, dtype=torch.int32, device=self.device))
        self.buffer: Optional[SymmetricBuffer] = None
        self._handshakes: dict = {}  # phase -> the handshake-only ExchangeArgs (see _exchange)
        self._scratch_plans: dict = {}  # op shape -> ScratchPlan (see _scratch)
        # The layout of the dispatch whose combine input the buffer holds now (weak: see _is_combine_input).
        self._combine_input_owner: Optional[weakref.ref] = None
        # Whether peers may still read this rank's memory that an in-place combine named as its input:
        # set by such a combine, cleared by the next op's handshake (every op starts with one, in
        # _exchange or _layout_and_exchange), after which every peer has finished that combine.
        self._peers_may_read_arena = False
        # The stream of the last launch: an op on another stream first waits for it (see _stream).
        self._last_stream_handle: Optional[int] = None
        self._last_stream: Optional[torch.cuda.Stream] = None
        self._launches = 0  # _stream() calls: whether an op enqueued anything before it failed (op_range)
        self._failed_mid_op: Optional[str] = None  # why this rank is out of step with its peers (op_range)

    def _construction_facts(self) -> dict:
        # Kernels wait for as many blocks of every peer as they run themselves, and the regions hold
        # one completion flag per (peer, block): ranks must run the same grid (0 = autosize, which
        # then takes the smallest rank's size).
        return {**super()._construction_facts(), "num_sms": self.config.num_sms}

    def _open_buffer(self, region_bytes: int, count_words: int) -> None:
        """Allocate this rank's symmetric buffer and open every peer's (a collective)."""
        self.buffer = SymmetricBuffer(self.group, device=self.device, region_bytes=region_bytes,
                                      count_words=count_words, timeout_s=self.config.timeout_s, backend=self.name,
                                      phase_names=self.phase_names, peer_watch_s=self.config.peer_watch_s,
                                      on_host=self.config.gloo_host_words)

    def _device_sms(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def _resolve_num_blocks(self, sharing: int) -> int:
        """Blocks per rank: ``config.num_sms``, or with 0 the autosized count (the fabric model's link
        bandwidths; defaults with a warning where unknown). Every rank uses the smallest rank's count:
        the kernels wait for as many blocks of every peer as they run themselves."""
        if self.config.num_sms > 0:
            return self.config.num_sms
        nvlink, scaleout = gpu_link_bandwidths(self.device.index)
        try:
            mine = resolve_num_sms(self.config, device_sms=self._device_sms(), ranks_sharing_gpu=sharing,
                                   num_ranks=self.num_ranks, num_experts=self.num_experts, topk=self.autosize_topk,
                                   hidden_bytes=2 * self.hidden_size, nvlink_gbytes_per_s=nvlink,
                                   scaleout_gbytes_per_s=scaleout, sm_read_gbytes_per_s=self.sm_read_gbytes_per_s,
                                   sm_write_gbytes_per_s=self.sm_write_gbytes_per_s)
        except ValueError as error:  # not one block fits here: every rank refuses, none waits for this one
            mine = str(error)
        everyone = self._host.all_gather_object(mine, where="autosizing num_sms")
        refused = [rank for rank, value in enumerate(everyone) if isinstance(value, str)]
        if refused:
            self._refuse_build(refused, everyone[refused[0]])
        return min(everyone)

    def _check_co_residency(self, sharing: int) -> None:
        """Refuse (before any launch) grids that could not all be resident at once: spin-waiting blocks
        of ranks sharing a GPU deadlock when some of them cannot be scheduled. Every rank refuses when one
        rank's grid does not fit (one exchange): a rank that refused alone (its own EP_PLUGIN_MAX_SMS_PER_GPU
        or MPS percentage) would leave its peers waiting for it in the buffer's exchange."""
        sms, percentage = self.config.max_sms_per_gpu or self._device_sms(), mps_thread_percentage()
        mine = (co_residency_limit(sms, sharing, percentage),
                co_residency_problem(self.num_blocks, sharing, sms, percentage))
        everyone = self._host.all_gather_object(mine, where="checking that every rank's blocks fit on its GPU")
        over = [rank for rank, (_, problem) in enumerate(everyone) if problem]
        if over:
            tightest = min(over, key=lambda rank: everyone[rank][0])  # its fix is the one that fits every rank
            self._refuse_build(over, everyone[tightest][1])

    def _refuse_build(self, ranks: list[int], problem: str) -> None:
        """ValueError on every rank: the build's exchange found ``problem`` on ``ranks``."""
        where = "on this rank" if ranks == [self.rank] else f"on rank(s) {ranks}"
        raise ValueError(f"backend {self.name!r}, {where}: {problem}")

    # ---- the send-side layout (both backends) -----------------------------------------------

    def _scratch(self, key, fields: Callable[[], Iterable[tuple]]) -> "Scratch":
        """A fresh ``Scratch`` for an op, its plan cached under ``key`` (``fields()`` runs on a miss). ``key``
        must decide every field that an argument struct built once over the plan's pieces takes
        (``Scratch.args``)."""
        plan = self._scratch_plans.get(key)
        if plan is None:
            if len(self._scratch_plans) >= 64:  # token counts that vary from step to step
                self._scratch_plans.clear()
            plan = self._scratch_plans[key] = ScratchPlan(fields())
        return Scratch(plan, self.device)

    @staticmethod
    def layout_fields(routing: Routing, probs: Optional[torch.Tensor], num_ranks: int) -> list[tuple]:
        """The scratch pieces ``_layout`` writes (see there), for ``ScratchPlan``."""
        T, E, R = routing.num_tokens, routing.num_experts, num_ranks
        fields = [("send_slot", (T, R), torch.int32), ("k_index", (T, E), torch.int32),
                  ("expert_counts", (E,), torch.int32), ("rank_counts", (R,), torch.int32)]
        if routing.form != ROUTING_MAP:
            fields.append(("input_flags", (R,), torch.int32))
            if probs is not None:
                fields.append(("dense_probs", (T, E), torch.float32))
        return fields

    def _layout(self, routing: Routing, probs: Optional[torch.Tensor], scratch: "Scratch"):
        """Send-side layout: one kernel (``csrc/layout.cu``) on the current stream, no host sync.

        Args:
            routing: ``routing_map`` [T, E] bool or ``topk_idx`` [T, K] int64 (-1 = none), contiguous on
                this device (``make_routing`` checked dtype, shape and contiguity).
            probs: [T, E] float32 (routing map: used as is), [T, K] float32 (top-k), or None.
            scratch: holds the pieces of ``layout_fields``, which the kernel writes: send_slot [T, R]
                int32 (-1 = not sent), k_index [T, E] int32 (-1 = not routed), expert_counts [E] int32,
                rank_counts [R] int32, and in the top-k form input_flags [R] int32 and (with probs)
                dense_probs [T, E] float32. input_flags, per destination rank p:
                ``_C.INPUT_ID_OUT_OF_RANGE`` when some id was < -1 or >= E (such ids were dropped, never
                indexed), ``_C.INPUT_ID_REPEATED`` when a token named one of p's experts twice (it chose
                it once, with the prob of its last such slot). The count exchange carries them to every
                rank; blocking mode then refuses the dispatch everywhere, non-blocking mode goes on.
        Returns: the dense probs the send reads: ``probs`` itself (routing map), the address of
            dense_probs (top-k with probs), or None.
        """
        args, dense_probs = self._layout_args(routing, probs, scratch)
        self._C.layout(args, self.device.index, self._stream())
        return dense_probs

    def _layout_args(self, routing: Routing, probs: Optional[torch.Tensor], scratch: "Scratch"):
        """(``_C.LayoutArgs`` writing into ``scratch``, the dense probs ``_layout`` returns). The routing
        form and whether probs come are part of the scratch's plan (``layout_fields``)."""
        at = scratch.address
        args = scratch.args("layout", lambda: self._C.LayoutArgs(
            num_tokens=routing.num_tokens, num_ranks=self.num_ranks, num_local_experts=self.num_local_experts,
            send_slot=at("send_slot"), k_index=at("k_index"), expert_counts=at("expert_counts"),
            rank_counts=at("rank_counts"), max_blocks=self.num_blocks,
            input_flags=at("input_flags") if scratch.has("input_flags") else None,
            flags_since_checked=(self._flags_since_checked.data_ptr() if scratch.has("input_flags") and
                                 self._flags_since_checked is not None else None),
            dense_probs=at("dense_probs") if scratch.has("dense_probs") else None))
        dense_probs = None
        if routing.form == ROUTING_MAP:
            args.routing_map, dense_probs = routing.routing_map, probs  # probs are dense already
        else:
            args.topk_idx, args.topk = routing.topk_idx, routing.topk_idx.shape[1]
            if probs is not None:
                dense_probs = args.dense_probs
                args.probs = probs
        return args, dense_probs

    def _layout_and_exchange(self, routing: Routing, probs: Optional[torch.Tensor], scratch: "Scratch", phase: int,
                             fingerprint: int, *, addresses: Callable[[], dict], pad_multiple: int = 1,
                             receive_budget: Optional[int] = None, refused: Optional[str] = None):
        """``_layout`` and then ``_exchange`` of its counts, in one launch (``_C.layout_exchange``: the last
        layout block runs the exchange). ``addresses()``: where the exchange's outputs go in ``scratch``, as
        ``_C.ExchangeArgs`` fields (called when the struct is built: once per plan and address, see
        ``Scratch.args``); its inputs are the layout's pieces of ``scratch``; ``phase``, ``fingerprint``,
        ``pad_multiple`` and ``receive_budget`` (None: unbounded) are the op's own; ``refused``: why this rank
        refused its input (``_within_budget``), which the exchange tells every rank. Returns what ``_layout``
        does."""
        args, dense_probs = self._layout_args(routing, probs, scratch)
        at = scratch.address
        exchange = scratch.args("exchange", lambda: self._C.ExchangeArgs(
            phase=phase, num_local_experts=self.num_local_experts, expert_counts=at("expert_counts"),
            rank_counts=at("rank_counts"), input_flags=at("input_flags") if scratch.has("input_flags") else None,
            **addresses()))
        exchange.phase, exchange.fingerprint, exchange.pad_multiple = phase, fingerprint, pad_multiple
        exchange.receive_budget = self._C.UNBOUNDED_ROWS if receive_budget is None else receive_budget
        exchange.host_input_flags = 0 if refused is None else self._C.INPUT_TOO_MANY_TOKENS
        self._C.layout_exchange(self.buffer.raw, args, exchange, self._stream())
        self._peers_may_read_arena = False  # once enqueued, as in _exchange
        return dense_probs

    def _layout_tensors(self, routing: Routing, probs: Optional[torch.Tensor]):
        """``_layout`` into a scratch of its own, as tensors: (send_slot, k_index, expert_counts,
        rank_counts, dense_probs or None, input_flags or None), the form ``_layout_torch`` returns."""
        scratch = Scratch(ScratchPlan(CompiledBackend.layout_fields(routing, probs, self.num_ranks)), self.device)
        dense_probs = CompiledBackend._layout(self, routing, probs, scratch)
        if isinstance(dense_probs, int):
            dense_probs = scratch.tensor("dense_probs")
        return (scratch.tensor("send_slot"), scratch.tensor("k_index"), scratch.tensor("expert_counts"),
                scratch.tensor("rank_counts"), dense_probs,
                scratch.tensor("input_flags") if scratch.has("input_flags") else None)

    def _layout_torch(self, routing: Routing, probs: Optional[torch.Tensor]):
        """``_layout`` with torch ops (about 15 kernels): the oracle of ``tests/test_layout_gpu.py``.

        Same arguments and results, except that a token naming an expert twice gets a dense prob
        from ``scatter_`` (unspecified which duplicate).
        """
        T, E, R, L = routing.num_tokens, self.num_experts, self.num_ranks, self.num_local_experts
        input_flags = None
        if routing.form == ROUTING_MAP:
            mask = routing.routing_map
            dense_probs = probs
        else:
            idx = routing.topk_idx
            in_range = (idx >= 0) & (idx < E)
            input_flags = input_flags_torch(self._C, idx, R, L)
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
        return send_slot, k_index, expert_counts, rank_counts, dense_probs, input_flags

    # ---- rows in the buffer: the combine input handed to the caller ---------------------------

    def _combine_input_view(self, layout, offset: int, rows: int) -> torch.Tensor:
        """[rows, H] bf16 over this rank's buffer at region ``offset``, remembered on ``layout`` (its
        ``combine_input`` field) as the combine input handed out for that dispatch.

        Raises ValueError while the peers may still read the last in-place combine's input there (no op
        since that combine): the expert's write into the new view could overtake a slower peer's read."""
        if self._peers_may_read_arena:
            raise ValueError(
                "combine_input: the last combine read its input in place from this rank's buffer, and a slower "
                "peer may still be reading it; a combine input handed out now would overlap it. Another op of "
                "this backend first tells every rank that the peers are done (dispatch the next batch, or call "
                "backend.barrier()), or combine this handle from a tensor of your own")
        view = self.buffer.region_tensor(offset, (rows, self.hidden_size), torch.bfloat16)
        layout.combine_input = weakref.ref(view)
        self._combine_input_owner = weakref.ref(layout)  # the buffer holds one combine input
        return view

    def _is_combine_input(self, rows: torch.Tensor, layout, offset: int) -> bool:
        """Whether ``rows`` is the combine input at region ``offset`` (then combine reads it in place).

        Raises ValueError (before any launch) when it is, but the buffer's combine input was handed
        out for another dispatch: its rows are in that dispatch's order, and read in place for this
        one they would sum the wrong rows without a word."""
        if layout.combine_input is not None and layout.combine_input() is rows:
            in_buffer = True  # also decides an empty input, whose address says nothing
        else:
            in_buffer = rows.numel() > 0 and rows.data_ptr() == self.buffer.raw.region_address + offset
        owner = self._combine_input_owner() if self._combine_input_owner is not None else None
        if in_buffer and owner is not layout:
            raise ValueError(
                "combine: these rows are the backend's combine input, but the buffer holds it for another "
                "dispatch (combine_input was last called for another handle, or never for this one), or none (a "
                "combine since then copied rows over it); it holds one combine input at a time: call "
                "combine_input(handle) for this handle and write its rows there")
        return in_buffer

    # ---- helpers the stages use -------------------------------------------------------------

    def _stream(self) -> int:
        """The current stream's handle, for a launch. The device handshakes need this backend's kernels in
        the order they were enqueued: when the caller moved to another stream (a comm stream for some ops,
        say), that stream first waits for the previous one, so an op cannot overtake an earlier op still
        queued there."""
        handle = streams.stream_handle(self.device)
        if handle != self._last_stream_handle:
            self._follow_previous_stream(handle)
        self._launches += 1  # after the wait: a wait that raised queued nothing (op_range)
        return handle

    def _wait_for_queued_ops(self) -> None:
        """Make the current stream, about to write into this rank's buffer (a combine input), wait for this
        backend's ops queued so far: one still queued on another stream may use that memory (elastic's
        two-stage combine receives there; until an op after an in-place combine has met its peers, they
        may still read there). Nothing to wait for on the stream of the last op."""
        handle = streams.stream_handle(self.device)
        if handle != self._last_stream_handle:
            self._wait_for_last_stream(handle, streams.current_stream(self.device))

    def _follow_previous_stream(self, handle: int) -> None:
        current = streams.current_stream(self.device)
        self._wait_for_last_stream(handle, current)
        self._last_stream_handle, self._last_stream = handle, current

    def _wait_for_last_stream(self, handle: int, current: torch.cuda.Stream) -> None:
        """``current`` (raw ``handle``) waits for the stream of this backend's last op, where it may."""
        if self._last_stream is not None and self._may_wait(handle, self._last_stream_handle):
            current.wait_stream(self._last_stream)

    def _may_wait(self, stream: int, other: int) -> bool:
        """Whether ``stream`` may wait for ``other`` (handles): neither is capturing, or both are in one
        capture, where the wait becomes an edge of the graph (two branches of one graph run in any order
        at replay). A capture may not wait on work outside it, nor the other way round; torch.cuda.graph
        synchronizes before it starts capturing, so an op issued before the capture is done by then.
        An op outside a capture still in progress on ``other`` is not ordered either: it runs now, the
        captured op at each replay, and the ranks pair ops in the order they run."""
        status, capture = self._C.stream_capture_info(stream)
        other_status, other_capture = self._C.stream_capture_info(other)
        if status < 0 or other_status < 0:  # the query failed (a stream since destroyed, say): the plain rule
            return not torch.cuda.is_current_stream_capturing()
        if status == other_status == 0:
            return True
        return status == other_status == 1 and capture == other_capture

    def _keep_on_stream(self, *tensors) -> None:
        """The caller's inputs (EP_PLUGIN_AVOID_RECORD_STREAM: the caller keeps them alive instead)."""
        streams.keep_on_stream(self.device, tensors, avoid_record_stream=self.config.avoid_record_stream)

    def _keep_layout_on_stream(self, *tensors) -> None:
        """A handle's layout, which a combine or cached dispatch on another stream reads: tied to that stream
        always. Ours, not the caller's (who cannot see which of its pieces a kernel reads), so
        EP_PLUGIN_AVOID_RECORD_STREAM does not leave it to the caller: freed with a handle dropped right after
        the call, it went back to the dispatch stream's pool while the op was still queued."""
        streams.keep_on_stream(self.device, tensors, avoid_record_stream=False)

    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a dispatch output (tests replace this to surround outputs with canaries)."""
        return torch.empty(*shape, dtype=dtype, device=self.device)

    @staticmethod
    def _aligned(tensor: torch.Tensor) -> torch.Tensor:
        """Rows are moved in 16-byte words (and bulk copies need 16-byte addresses): copy a view
        that starts mid-word (rare: an odd storage offset) into fresh storage."""
        return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()

    def _next_handle_id(self) -> int:
        self._dispatch_count += 1
        return self._dispatch_count

    def _exchange(self, phase: int, fingerprint: int, op_word: Optional[int] = None, *,
                  input_read_in_place: bool = False, **counts) -> None:
        """The op prologue on the current stream: handshake with the op fingerprint (packed, see
        ``agreement.fingerprint_code``), plus the count exchange when ``counts`` are given (see
        ``_C.ExchangeArgs`` for the fields), or the op word this rank tells every peer (an int32).
        ``input_read_in_place``: the op (an in-place combine) lets the peers read its input in this
        rank's buffer, until the next op's handshake (see ``_combine_input_view``)."""
        if counts:
            fields = {"num_local_experts": self.num_local_experts, "pad_multiple": 1, **counts}
            args = self._C.ExchangeArgs(phase=phase, fingerprint=fingerprint, **fields)
        else:  # a handshake: the launch copies the struct, so one per phase serves every op (~4 µs a build)
            args = self._handshakes.get(phase)
            if args is None:
                args = self._handshakes[phase] = self._C.ExchangeArgs(phase=phase, fingerprint=0,
                                                                      num_local_experts=self.num_local_experts,
                                                                      pad_multiple=1)
            args.fingerprint = fingerprint
            args.publish_op_word = op_word is not None
            args.op_word = 0 if op_word is None else op_word
        self._C.exchange(self.buffer.raw, args, self._stream())
        # Only once enqueued (an argument the launch refuses leaves the arena closed): the peers' reads
        # of the last combine input come before this handshake completes.
        self._peers_may_read_arena = input_read_in_place

    def _mark(self) -> torch.cuda.Event:
        """An event after what the current stream has enqueued so far (for ``_wait_for_host``), the last op's
        stream included when that was another (a host wait before this rank's next launch, such as the
        hierarchical barrier's, must cover it)."""
        self._stream()
        event = torch.cuda.Event()
        event.record(streams.current_stream(self.device))
        return event

    def _wait_for_host(self, what: str, mark: Optional[torch.cuda.Event] = None) -> None:
        """Wait (with the timeout) until the current stream has run what was enqueued before ``mark``
        (default: what was enqueued so far)."""
        self.buffer.wait_event(mark if mark is not None else self._mark(), self.config.timeout_s + 5.0, what)

    def _dispatch_counts(self, counted: torch.cuda.Event, routing: Routing, refused: Optional[str] = None) -> list[int]:
        """Blocking mode: the mailbox words of a dispatch's count exchange ([0, MAILBOX_EXPERT_ROWS + L)),
        read once the exchange (before ``counted``) has run. The exchange told every rank each rank's
        input flags, so a dispatch whose top-k ids any rank got wrong raises ValueError here on every
        rank alike, before its rows are handed out; the backend stays usable. Kernels enqueued after
        ``counted`` (sends that need no host count) run meanwhile: they drop bad ids, never index them.
        """
        self._wait_for_host("the dispatch counts", counted)
        words = self.buffer.mailbox(0, self._C.MAILBOX_EXPERT_ROWS + self.num_local_experts)
        if words[self._C.MAILBOX_INPUT_FLAGS] or refused is not None:  # (the flag is this rank's own, too)
            try:
                self._refuse_flagged_input(words[self._C.MAILBOX_INPUT_FLAGS],
                                           words[self._C.MAILBOX_FLAGGED_RANKS] | (refused is not None) << self.rank,
                                           routing, refused)
            except ValueError as error:  # TooManyTokensError too
                error.raised_by_every_rank = True  # op_range: after the op's launches, yet the ranks in step
                raise
        return words

    def _refuse_flagged_input(self, flags: int, flagged_ranks: int, routing: Routing,
                              refused: Optional[str] = None) -> None:
        ranks = [r for r in range(self.num_ranks) if flagged_ranks >> r & 1]
        every = f"every rank of backend {self.name!r} refused this dispatch; the backend stays usable"
        # The flags word is the OR of every rank's (its own too), so every rank picks the same class.
        error = TooManyTokensError if flags == self._C.INPUT_TOO_MANY_TOKENS else ValueError
        if self.rank in ranks:
            if refused is not None:  # this rank ran the op with no tokens (_within_budget)
                raise error(f"{refused} (on rank {self.rank}); {every}")
            try:
                check_topk_values(routing.topk_idx, self.num_experts)  # names the id or the token
            except ValueError as exc:
                raise ValueError(f"{exc} (on rank {self.rank}); {every}") from None
        problems = []
        if flags & self._C.INPUT_ID_OUT_OF_RANGE:
            problems.append(f"topk_idx with an expert id outside -1 and [0, {self.num_experts})")
        if flags & self._C.INPUT_ID_REPEATED:
            problems.append("topk_idx with a token naming the same expert twice")
        if flags & self._C.INPUT_TOO_MANY_TOKENS:
            problems.append(self._too_many_tokens())
        raise error(f"rank(s) {ranks} of the group passed {' or '.join(problems)}: {every}")

    @property
    def refuses_input_in_exchange(self) -> bool:
        """Blocking mode: a token count past max_tokens_per_rank rides the count exchange (``_within_budget``),
        so every rank refuses it. Sync-free mode refuses it on the rank before any launch."""
        return self.config.blocking

    def _within_budget(self, hidden, routing: Routing, probs: Optional[torch.Tensor]) -> tuple:
        """(hidden, routing, probs, refused): the dispatch's input as it is, or, with more tokens than
        max_tokens_per_rank (blocking mode only: ``refuses_input_in_exchange``), the same with no rows and
        why this rank refuses it. The op then runs with no tokens of this rank, its count exchange tells every
        rank, and every rank raises ValueError at the count read (``_dispatch_counts``), as for bad top-k ids:
        the ranks stay in step and the backend usable."""
        if routing.num_tokens <= self.config.max_tokens_per_rank:
            return hidden, routing, probs, None
        if not self.config.blocking:  # no count read would raise: refuse here, before any launch
            raise ValueError(self._over_budget(routing.num_tokens))

        def none_of(tensor):  # zero rows of the same dtype, columns and device
            return None if tensor is None else tensor[:0]

        refused = self._over_budget(routing.num_tokens)
        hidden = (none_of(hidden[0]), none_of(hidden[1])) if isinstance(hidden, (tuple, list)) else none_of(hidden)
        routing = Routing(routing.form, 0, routing.num_experts, routing_map=none_of(routing.routing_map),
                          topk_idx=none_of(routing.topk_idx))
        return hidden, routing, none_of(probs), refused

    # ---- lifecycle / errors -------------------------------------------------------------------

    def check_errors(self, synchronize: bool = True) -> None:
        """Raise what the device reported: EPTimeoutError (a wait timed out), EPError (ranks disagreed on
        an op), and, after a sync, ValueError if a non-blocking top-k dispatch since the last such error
        held expert ids out of range (they were dropped). ``synchronize`` waits for the device first
        (EPTimeoutError past timeout_s)."""
        if synchronize:
            self.buffer.synchronize("check_errors")
        self.buffer.raise_if_failed()
        flags = self._flags_since_checked
        if synchronize and flags is not None and int(flags.item()) & self._C.INPUT_ID_OUT_OF_RANGE:
            flags.zero_()  # done before returning: a next op on another stream cannot OR before it
            torch.cuda.current_stream(self.device).synchronize()
            raise dropped_ids_error(self.num_experts)

    @op_range("barrier")  # also: a host wait that gives up after the handshake was enqueued leaves it out of step
    def _barrier(self) -> None:
        """Every rank of the domain reaches this point (a device handshake; the host waits for it)."""
        self.buffer.raise_if_failed()
        self._exchange(self.barrier_phase, fingerprint_code(OP_BARRIER))
        self._wait_for_host("the barrier")

    def check_usable(self) -> None:
        """Also what the device reported (a timed-out wait, ranks that disagreed), as every op checks first,
        and an op that failed here after its first launch (``op_range``)."""
        super().check_usable()
        if self._failed_mid_op is not None:
            raise self._out_of_step_error("an earlier")
        if self.buffer is not None:
            self.buffer.raise_if_failed()

    def _out_of_step_error(self, which: str) -> EPError:
        """``which``: "this" (the op failing now) or "<op> refused: an earlier"."""
        return EPError(f"ep_plugin {self.name}: rank {self.rank}: {which} {self._failed_mid_op}; its peers ran "
                       "that op, so this rank is out of step with them: build a new backend (on every rank)")

    def destroy(self) -> None:
        try:
            if self.buffer is not None:
                self.buffer.destroy(keep_memory=self.keep_buffer_memory)
        finally:  # destroyed also where the buffer's last wait failed: every op refuses from now on
            super().destroy()


SCRATCH_ALIGN_BYTES = 64  # every piece starts on its own 64-byte boundary (the kernels' vector loads need 16)


class ScratchPlan:
    """Where each of an op's small device tensors lies in one allocation (see ``Scratch``).

    ``fields``: (name, shape, dtype) for each piece; dtypes of 4 or 8 bytes.
    """

    __slots__ = ("pieces", "words", "splits", "prepared")

    # Allocations whose argument structs a plan remembers (see prepared_at): a decode loop gets two or
    # three addresses back from torch's allocator, a training step one per MoE layer whose handle waits
    # for the backward. Each is a few small objects.
    PREPARED_BASES = 256

    def __init__(self, fields: Iterable[tuple]) -> None:
        self.pieces: dict[str, tuple] = {}  # name -> (first int32 word, words, shape, dtype)
        size = 0
        for name, shape, dtype in fields:
            size = -(-size // SCRATCH_ALIGN_BYTES) * SCRATCH_ALIGN_BYTES
            nbytes = math.prod(shape) * dtype.itemsize
            self.pieces[name] = (size // 4, nbytes // 4, tuple(shape), dtype)
            size += nbytes
        self.words = max(1, size // 4)
        self.splits: dict[tuple, tuple] = {}  # names -> how Scratch.tensors cuts them (see split_of)
        self.prepared: dict[int, dict] = {}  # allocation address -> the structs built over it (prepared_at)

    def prepared_at(self, base: int) -> dict:
        """The argument structs built over an allocation of this plan at address ``base`` (see
        ``Scratch.args``), by key: every address in them is ``base`` plus a piece's offset, so they
        serve any later allocation of this plan that torch hands out at the same address."""
        structs = self.prepared.get(base)
        if structs is None:
            if len(self.prepared) >= self.PREPARED_BASES:  # addresses that keep changing: start afresh
                self.prepared.clear()
            structs = self.prepared[base] = {}
        return structs

    def split_of(self, names: tuple[str, ...]) -> tuple:
        """(first word, end word, dtype, sizes) for ``Scratch.tensors(names)``: the run of words from the
        first piece to the end of the last, in elements of their dtype, cut into piece, gap, piece, ...
        The pieces must be 1-D, of one dtype and in plan order."""
        pieces = [self.pieces[name] for name in names]
        dtype = pieces[0][3]
        words_per_element = dtype.itemsize // 4
        sizes, end = [], pieces[0][0]
        for name, (start, words, shape, piece_dtype) in zip(names, pieces, strict=True):
            if piece_dtype != dtype or len(shape) != 1 or start < end:
                raise ValueError(f"Scratch.tensors{names}: {name!r} is not a 1-D {dtype} piece after the ones "
                                 "before it")
            if sizes:
                sizes.append((start - end) // words_per_element)  # the gap before this piece
            sizes.append(words // words_per_element)
            end = start + words
        return pieces[0][0], end, dtype, sizes


class Scratch:
    """An op's small device tensors (layout, counts, row bases) carved from one int32 allocation.

    A dispatch needs a dozen of them and each ``torch.empty`` costs ~4 µs of host time on the H200
    bed (a view ~1.6): the kernels take the pieces' addresses, and a tensor view is made only for
    what Python hands out or reads (``tensor``). Whoever holds the scratch (the op's handle) keeps
    every piece alive; stream order makes reuse after that safe, as for any torch allocation.
    """

    __slots__ = ("memory", "base", "plan", "prepared")

    def __init__(self, plan: ScratchPlan, device: torch.device) -> None:
        self.memory = torch.empty(plan.words, dtype=torch.int32, device=device)
        self.base = self.memory.data_ptr()
        self.plan = plan
        self.prepared = plan.prepared_at(self.base)  # structs over these addresses, shared (see args)

    def has(self, name: str) -> bool:
        return name in self.plan.pieces

    def address(self, name: str) -> int:
        return self.base + 4 * self.plan.pieces[name][0]

    def args(self, key, build: Callable[[], object]):
        """The argument struct ``build()`` makes over this scratch's pieces, built once per plan and
        address: torch's allocator hands a loop of one shape the same few addresses again, and
        building a struct costs several µs of the host time that paces eager decode (twenty-ninth
        pass in benchmarks/NOTES.md). ``build`` sets only fields that ``key``, the plan and the
        backend decide; the caller sets the op's own fields (its tensors, budget) on every call,
        whatever an earlier op set (a launch copies the struct, so that is safe)."""
        args = self.prepared.get(key)
        if args is None:
            args = self.prepared[key] = build()
        return args

    def tensor(self, name: str) -> torch.Tensor:
        """The piece as a tensor of its shape and dtype (a view of the allocation)."""
        start, words, shape, dtype = self.plan.pieces[name]
        piece = self.memory[start:start + words]
        if dtype != torch.int32:
            piece = piece.view(dtype)
        return piece.view(shape) if len(shape) != 1 else piece

    def tensors(self, names: tuple[str, ...]) -> list[torch.Tensor]:
        """Views of several 1-D pieces of one dtype, in plan order, made by one split of the run they
        lie in: a dispatch hands out three or four such counts, and each separate view costs two or
        three torch calls (~1.5-3 µs each) of the host time that paces eager decode."""
        split = self.plan.splits.get(names)
        if split is None:
            split = self.plan.splits[names] = self.plan.split_of(names)
        start, end, dtype, sizes = split
        run = self.memory[start:end]
        if dtype != torch.int32:
            run = run.view(dtype)
        return run.split_with_sizes(sizes)[::2]  # the pieces, without the gaps between them


def earlier_repeats(idx: torch.Tensor) -> torch.Tensor:
    """[T, K] bool: the slots whose id a later slot of the same token names again (the kernels count a
    repeated expert once, at its last slot, and drop the earlier ones)."""
    later = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=idx.device).triu(1)
    return ((idx.unsqueeze(2) == idx.unsqueeze(1)) & later).any(2)


def input_flags_torch(extension, idx: torch.Tensor, num_ranks: int, num_local_experts: int) -> torch.Tensor:
    """The layout kernel's input_flags [R] int32 for top-k ids ``idx`` [T, K], with torch ops (its oracle)."""
    R, L = num_ranks, num_local_experts
    E = R * L
    out_of_range = bool(((idx < -1) | (idx >= E)).any())
    repeated = earlier_repeats(idx) & (idx >= 0) & (idx < E)
    owners = torch.where(repeated, idx // L, R).flatten()  # index R collects "not repeated"
    flagged = torch.zeros(R + 1, dtype=torch.int32, device=idx.device).index_fill_(0, owners, 1)[:R]
    return flagged * extension.INPUT_ID_REPEATED + (extension.INPUT_ID_OUT_OF_RANGE if out_of_range else 0)
