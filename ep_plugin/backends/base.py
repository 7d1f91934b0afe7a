"""The protocol every backend implements, with the input checks they all share.

A backend instance is bound to one process group and one (hidden_size, num_experts)
shape, like a communication buffer. ``dispatch``/``combine`` here validate input and
then call the backend's ``_dispatch``/``_combine``; nothing reaches a collective or a
kernel before the checks pass, so a rejected call leaves the backend usable.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .. import streams
from ..agreement import check_construction
from ..config import MAX_PAD_MULTIPLE, Config, is_int
from ..errors import BackendUnavailableError
from ..handle import CombineOutput, DispatchOutput, Handle
from ..host_collectives import HostCollectives
from ..routing import TOPK, Routing, check_tensor, check_topk_values, make_routing, route_counts
from ..topology import Topology, resolve_topology


def check_pad_multiple(pad_multiple, name: str = "pad_multiple") -> None:
    """ValueError unless ``pad_multiple`` is an int in [1, MAX_PAD_MULTIPLE] (a dispatch's, or a sizing's);
    ``name``: the argument it came in as."""
    if not (is_int(pad_multiple) and 1 <= pad_multiple <= MAX_PAD_MULTIPLE):
        raise ValueError(f"{name} must be an int in [1, {MAX_PAD_MULTIPLE}], got {pad_multiple!r}")


# DeepEP's per-call stream arguments, which our ops do not take (they run on the current stream): a call that
# passes them is told what to do instead.
DEEPEP_STREAM_OPTIONS = ("async_finish", "allocate_on_comm_stream", "previous_event", "async_with_compute_stream")


@dataclass(frozen=True)
class Capabilities:
    devices: tuple[str, ...]  # "cpu", "cuda"
    hidden_dtypes: tuple[torch.dtype, ...]
    probs_dtypes: tuple[torch.dtype, ...]
    fp8_dispatch: bool = False
    non_blocking: bool = False
    cuda_graphs: bool = False
    # Routing forms dispatch takes ("routing_map" with probs, "topk" with topk_weights).
    routing_forms: tuple[str, ...] = ("routing_map", "topk")
    # Backend-specific keyword options of dispatch / combine (validated by name before any launch).
    dispatch_options: tuple[str, ...] = ()
    combine_options: tuple[str, ...] = ()
    # What a cached dispatch (``dispatch(hidden, handle=...)``) takes besides bf16 rows: its options, FP8 pairs.
    cached_dispatch_options: tuple[str, ...] = ()
    cached_fp8: bool = False


def _default_device(device: Optional[torch.device | str]) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _check_arguments(name: str, capabilities: Capabilities, group: Optional[dist.ProcessGroup], hidden_size: Any,
                     num_experts: Any, device: Optional[torch.device | str]) -> None:
    """The constructor checks that need no other rank (they run before any collective)."""
    if not dist.is_initialized():
        raise RuntimeError(f"ep_plugin backend {name!r} needs torch.distributed to be initialized first")
    num_ranks = dist.get_world_size(group if group is not None else dist.group.WORLD)
    if not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by the {num_ranks} ranks of the group")
    if "cpu" not in capabilities.devices and not torch.cuda.is_available():  # before any CUDA call (it asserts)
        raise BackendUnavailableError(f"backend {name!r} needs a CUDA GPU; torch sees none (torch "
                                      f"{torch.__version__}, built for CUDA {torch.version.cuda})")
    if _default_device(device).type not in capabilities.devices:
        raise ValueError(f"backend {name!r} runs on {capabilities.devices}, not on {_default_device(device)}")


def merge_alignment(pad_multiple: Optional[int], expert_alignment: Optional[int]) -> Optional[int]:
    """``expert_alignment`` is DeepEP's name for ``pad_multiple``: one of them, or both equal."""
    if expert_alignment is None:
        return pad_multiple
    check_pad_multiple(expert_alignment, "expert_alignment")
    if pad_multiple is not None and pad_multiple != expert_alignment:
        raise ValueError(f"pad_multiple={pad_multiple} and expert_alignment={expert_alignment} disagree; "
                         "pass one of them")
    return expert_alignment


class Backend(abc.ABC):
    """Dispatch/combine over one expert-parallel process group.

    Building a backend first settles the group's topology (``topology=``, else detected; a collective,
    see ``ep_plugin.topology``). Where it has more than one NVLink domain, and the backend needs one
    domain (``needs_shared_memory``) or the domain size was forced (``EP_PLUGIN_SCALEUP_SIZE`` or an
    explicit ``topology``), the constructor returns a ``HierarchicalBackend`` that runs this backend
    inside each domain and joins the domains over the rails, with the same API and the same results.
    """

    name: str = "base"
    capabilities: Capabilities
    # The backend maps its peers' memory, so it can only span one NVLink domain.
    needs_shared_memory: bool = False
    # Top-k ids are range- and repeat-checked by the backend's own kernels, every rank told of any
    # rank's bad ids (so blocking mode needs no host read of them before the op).
    checks_ids_on_device: bool = False
    # A dispatch's input (its token count, its top-k ids) is checked on the host inside the op
    # (``_refused_input``), and the verdict travels in the op's first exchange, so that every rank raises
    # ValueError, not only the one with the bad input, and the backend stays usable.
    refuses_input_in_exchange: bool = False
    # Whether the op running now was recorded by autograd, so its backward will run on this rank: set
    # by ``ep_plugin.dispatch``/``combine`` around the call, and part of the op's fingerprint
    # (``OpFingerprint.grad``). Ranks that differ (inputs needing grad on some ranks only) raise EPError
    # at the forward instead of leaving the others waiting in a backward this rank never runs.
    op_records_backward: bool = False
    # Whether that op is a dispatch whose probs (or top-k weights) need a gradient (``OpFingerprint.probs_grad``):
    # its backward routes them back, which ranks must agree on as well.
    op_probs_need_grad: bool = False
    destroyed: bool = False  # set by destroy(): every op refuses afterwards
    # Whether a combine with row_probs reads the caller's top-k ids of its dispatch again (the compiled
    # backends keep that tensor in their layout, not a copy): only then is a change in place since refused
    # (``check_topk_ids_unchanged``, on that rank alone). The others route values back by the layout their
    # dispatch built, which a later write to the ids cannot change.
    combine_reads_topk_ids: bool = False
    # Whether a dispatch's handed-out counts (``tokens_per_expert``, ``handle.num_real_tokens_per_expert``) are
    # the memory the handle's later kernels read (the cached dispatch, the backward of combine: the compiled
    # backends, to save a copy per dispatch): then a change in place since the dispatch is refused
    # (``check_counts_unchanged``, on that rank alone), instead of zeroing other experts' rows there.
    kernels_read_handed_out_counts: bool = False

    def __new__(cls, group: Optional[dist.ProcessGroup] = None, *, topology: Optional[Topology] = None,
                **kwargs: Any) -> "Backend":
        if getattr(cls, "_spans_domains", False):  # the hierarchical wrapper itself
            return super().__new__(cls)
        # Arguments that are wrong on this rank alone are raised after the topology's exchange, which tells
        # the other ranks: they raise too, instead of waiting for this one in their next collective.
        config, refusal = kwargs.get("config"), None
        try:  # the device first: the exchange runs on it, also where another argument is refused
            device = _default_device(kwargs.get("device"))
        except Exception:  # noqa: BLE001 - refused below (_check_arguments), after the exchange
            device = torch.device("cpu")
        try:
            _check_arguments(cls.name, cls.capabilities, group, kwargs.get("hidden_size"), kwargs.get("num_experts"),
                             kwargs.get("device"))
            cls.check_build_arguments(group, **({"topology": topology} if topology is not None else {}), **kwargs)
            config = config if config is not None else Config.from_env()
        except Exception as error:  # noqa: BLE001 - raised after the exchange, on this rank as it was
            if not dist.is_initialized():  # no exchange to tell anyone
                raise
            refusal, config = error, config if isinstance(config, Config) else Config.of_what_parses()
        resolved = resolve_topology(topology, group, device, config, purpose=f"building the {cls.name} backend",
                                    refusal=None if refusal is None else f"{type(refusal).__name__}: {refusal}")
        if refusal is not None:
            try:
                raise refusal
            finally:  # the traceback holds this frame: holding the error too would keep both to a full collection
                refusal = None
        if resolved.is_hierarchical and (resolved.forced or cls.needs_shared_memory):
            from .hierarchical import HierarchicalBackend

            return HierarchicalBackend(group, domain_backend=cls, topology=resolved, **kwargs)
        instance = super().__new__(cls)
        instance._topology = resolved
        return instance

    @classmethod
    def check_build_arguments(cls, group: Optional[dist.ProcessGroup] = None, **kwargs: Any) -> None:
        """Refuse constructor arguments that are wrong on this rank alone, before any exchange (``__new__``
        carries the refusal in the topology's): ones ``__init__`` does not take; a subclass checks its own
        values too (``super().check_build_arguments(group, **kwargs)`` first)."""
        inspect.signature(cls.__init__).bind(None, *(() if group is None else (group,)), **kwargs)

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        hidden_size: int,
        num_experts: int,
        config: Optional[Config] = None,
        device: Optional[torch.device | str] = None,
        topology: Optional[Topology] = None,
    ) -> None:
        """Args:
            group: the expert-parallel process group (default: the world).
            hidden_size / num_experts: H and E over the whole group (E divisible by its ranks).
            config: knobs (default ``Config.from_env()``).
            device: this rank's device (default: the current CUDA device, else CPU).
            topology: domains and rails (``ep_plugin.topology.Topology``; default: detected).
        """
        _check_arguments(self.name, self.capabilities, group, hidden_size, num_experts, device)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.config = config if config is not None else Config.from_env()
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.num_ranks
        self.device = _default_device(device)
        # Settled in __new__ (a flat backend: one domain, or one that does not need it).
        self.topology: Topology = getattr(self, "_topology", None) or topology or Topology.flat(self.num_ranks,
                                                                                               self.rank)
        # The backend's host exchanges (the protocol's barrier, a compiled backend's setup), timed like
        # every host wait: a rank that failed alone makes the others raise naming it. Made first: over
        # NCCL it holds the group's gloo twin, which the construction check and the buffer then share.
        self._host = HostCollectives(self.group, owner=f"ep_plugin {self.name}", timeout_s=self.config.timeout_s,
                                     label="backend", device=self.device,
                                     on_host=self.config.gloo_host_words)
        # Last, and before any subclass setup exchanges buffers: ranks built differently raise
        # ValueError here, on every rank, instead of crashing inside a later collective.
        check_construction(self.group, self.name, self._construction_facts(), timeout_s=self.config.timeout_s,
                           device=self.device, on_host=self.config.gloo_host_words)

    def _construction_facts(self) -> dict[str, Any]:
        """What every rank of the group must have built this backend with (compared by value).

        Runs at the end of ``Backend.__init__``, before a subclass's own setup: return only what
        the arguments, the config and the group decide. A subclass adds its own facts with
        ``{**super()._construction_facts(), "num_sms": self.config.num_sms, ...}``.

        Left out on purpose: knobs that only shape this rank's own work, which ranks may set
        differently without harm: ``timeout_s``; ``pad_multiple`` (a per-call default that pads the
        receiver's own output); ``num_permuted_tokens`` (the receiver's output budget);
        ``avoid_record_stream``, ``bulk_copy`` (local stream policy, local copy engine);
        ``max_sms_per_gpu`` (each rank's own co-residency limit: a grid past any rank's is refused on
        every rank); and the device (gloo stages CUDA tensors through the host). Topology and kernel-grid
        facts (``num_sms`` sizes the compiled backends' per-block regions) belong to the backends that have
        them.
        """
        return {
            "backend": self.name,
            "hidden_size": self.hidden_size,
            "num_experts": self.num_experts,
            # Buffers and worst-case outputs are sized from it on every rank.
            "max_tokens_per_rank": self.config.max_tokens_per_rank,
            # Blocking mode refuses a dispatch with bad expert ids (the rank leaves the op) while
            # non-blocking mode drops them on the device (the rank goes on): ranks must choose alike.
            "blocking": self.config.blocking,
        }

    # ---- public, validated entry points -------------------------------------------------

    def dispatch(
        self,
        hidden: torch.Tensor,
        *,
        routing_map: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        pad_multiple: Optional[int] = None,
        handle: Optional[Handle] = None,
        expert_alignment: Optional[int] = None,
        **options,
    ) -> DispatchOutput:
        """Send each token to the ranks of its experts (no autograd; see ``ep_plugin.dispatch``).

        Args:
            hidden: [T, H] tokens of this rank, dtype in ``capabilities.hidden_dtypes``.
            routing_map / probs: [T, E] bool / [T, E] float32, or
            topk_idx / topk_weights: [T, k] int64 (-1 = none) / [T, k] float32.
            pad_multiple: pad each local expert's segment to a multiple of this (default config).
            handle: a previous dispatch's handle: send ``hidden`` (same T) along its layout, no routing
                arguments (cached dispatch: no layout, no count exchange; the rows of combine's backward).
            expert_alignment: DeepEP's name for ``pad_multiple``.
            options: the backend's own dispatch options (``capabilities.dispatch_options``; a cached
                dispatch: ``capabilities.cached_dispatch_options``).
        Returns: DispatchOutput(hidden [R, H], probs [R] or None, tokens_per_expert [L] int64, handle, ...).
        """
        self.refuse_if_destroyed("dispatch")
        pad_multiple = merge_alignment(pad_multiple, expert_alignment)
        if handle is not None:
            self.check_not_capturing("cached dispatch")
            self.check_cached_routing(handle, pad_multiple, routing_map, probs, topk_idx, topk_weights)
            self.check_options("cached dispatch", options, self.capabilities.cached_dispatch_options)
            self.check_dispatch_flags(**options)  # their values too, before anything moves
            self.check_handle(handle)
            self.check_counts_unchanged(handle)
            return self._cached_dispatch(hidden, handle, **options)
        self.check_not_capturing("dispatch")
        self.check_options("dispatch", options, self.capabilities.dispatch_options)
        routing, weights, pad_multiple = self.check_dispatch_input(
            hidden, routing_map=routing_map, probs=probs, topk_idx=topk_idx, topk_weights=topk_weights,
            pad_multiple=pad_multiple)
        out = self._dispatch(hidden, routing, weights, pad_multiple, **options)
        # Kept, not copied: see check_topk_ids_unchanged. (Inference tensors have no version, and no backward.)
        if self.combine_reads_topk_ids and routing.form == TOPK and not routing.topk_idx.is_inference():
            out.handle.topk_ids = (routing.topk_idx, routing.topk_idx._version)
        # The counts are views of one allocation, sharing one version counter: one of them stands for all.
        if self.kernels_read_handed_out_counts and not out.tokens_per_expert.is_inference():
            out.handle.counts_version = (out.tokens_per_expert, out.tokens_per_expert._version)
        return out

    def check_cached_routing(self, handle: Handle, pad_multiple: Optional[int], *routing) -> None:
        """A cached dispatch (``handle=``) takes no routing arguments: the handle has them. Its alignment may be
        restated (DeepEP V2 code passes the same ``expert_alignment`` to both calls), but not changed."""
        if any(v is not None for v in routing):
            raise ValueError("a cached dispatch (handle=...) takes no routing arguments: the handle has them")
        if pad_multiple is not None:
            self.check_handle(handle)
            if not is_int(pad_multiple) or pad_multiple != handle.pad_multiple:
                raise ValueError(f"a cached dispatch pads as its handle's dispatch did (pad_multiple / "
                                 f"expert_alignment {handle.pad_multiple}); got {pad_multiple}")

    def dispatch_again(self, hidden: torch.Tensor, handle: Handle) -> torch.Tensor:
        """Dispatch new tokens along a cached layout (backward of combine). Returns [R, H]."""
        self.refuse_if_destroyed("dispatch_again")
        self.check_not_capturing("dispatch_again")
        self.check_handle(handle)
        self.check_hidden("hidden", hidden, handle.num_tokens)
        self.check_counts_unchanged(handle)
        return self._dispatch_again(hidden, handle)

    def combine(self, rows: torch.Tensor, handle: Handle, *, row_probs: Optional[torch.Tensor] = None,
                **options) -> CombineOutput:
        """Return each token's rows summed at its source (unweighted).

        Args:
            rows: [R, H] in the layout that dispatch produced for ``handle``.
            row_probs: optional per-row values sent back unsummed (backward of probs), shaped like the
                dispatched probs ([R], or [R, k] for a compact dispatch).
            options: the backend's own combine options (``capabilities.combine_options``).
        Returns: CombineOutput(hidden [T, H], probs shaped like the dispatched probs or None).
        """
        self.refuse_if_destroyed("combine")
        self.check_not_capturing("combine")
        self.check_options("combine", options, self.capabilities.combine_options)
        self.check_handle(handle)
        self.check_hidden("rows", rows, handle.num_rows)
        if row_probs is not None:
            if handle.probs_shape is None:
                raise ValueError("row_probs given but this handle's dispatch carried no probs")
            check_tensor("row_probs", row_probs, dtypes=self.capabilities.probs_dtypes,
                         shape=handle.expected_row_probs_shape(), device=self.device)
            self.check_topk_ids_unchanged(handle)
        return self._combine(rows, handle, row_probs, **options)

    @staticmethod
    def check_topk_ids_unchanged(handle: Handle) -> None:
        """ValueError when the top-k ids of ``handle``'s dispatch were changed in place since, on a backend whose
        combine with ``row_probs`` routes the values back by them (``combine_reads_topk_ids``; DeepEP V2 copies
        them into its handle; keeping the caller's tensor saves a copy per dispatch). A change torch does not see
        (a CUDA-graph replay writing the tensor) goes unnoticed: the ids must stay as they were until the combine
        and its backward."""
        if handle.topk_ids is None:
            return
        ids, version = handle.topk_ids
        if ids._version != version:
            raise ValueError("the topk_idx of this handle's dispatch was changed in place after the dispatch (a write "
                             "to any view of its storage counts), and a combine with row_probs (the backward of the "
                             "dispatch's topk_weights) routes the values back by it; keep it unchanged until then, "
                             "or dispatch a copy (topk_idx.clone())")

    @staticmethod
    def check_counts_unchanged(handle: Handle) -> None:
        """ValueError when the counts a dispatch handed out were changed in place since, on a backend whose
        later kernels of that handle read them (``kernels_read_handed_out_counts``): a cached dispatch or the
        backward of combine would zero (or leave) rows by the changed segment lengths. Counts are ordinary
        tensors: derive from them out of place (``tokens_per_expert.cumsum(0)``, ``.clone()``). They are views
        of one allocation, with ``num_valid_rows`` and hybrid's ``over_budget``: a write to any counts."""
        if handle.counts_version is not None and handle.counts_version[0]._version != handle.counts_version[1]:
            raise ValueError("the counts of this handle's dispatch (tokens_per_expert, num_real_tokens_per_expert, "
                             "num_valid_rows or hybrid's over_budget: views of one allocation) were changed in "
                             "place after the dispatch, and this op (a cached dispatch, or the backward of "
                             "combine) reads them to place and pad the rows; derive from them out of place "
                             "(tokens_per_expert.cumsum(0), or a .clone() to change)")

    # Whether the backend can be built with a combine-input arena (``combine_input_rows``; hybrid): the Megatron
    # integration gives such a backend its default arena.
    has_combine_input_arena = False

    def combine_input(self, handle: Handle) -> torch.Tensor:
        """Buffer memory for the experts' output, which combine then reads in place (hybrid built with
        ``combine_input_rows``). Refused (ValueError) by a backend without it, so that code written for hybrid
        says why on any backend: combine a tensor of your own."""
        self.refuse_if_destroyed("combine_input")
        raise ValueError(f"combine_input: backend {self.name!r} has no combine-input arena (hybrid has one, built "
                         "with combine_input_rows); combine a tensor of your own")

    @contextlib.contextmanager
    def combine_input_arena(self) -> Iterator[bool]:
        """As hybrid's context, which yields whether allocations inside go to its arena: never on a backend
        without one, so what is allocated inside is ordinary memory, and code written for hybrid runs unchanged."""
        yield False

    def barrier(self) -> None:
        """Block until every rank of the group reaches this point. A rank that does not arrive within
        ``config.timeout_s`` makes the others raise ``EPTimeoutError`` naming it."""
        self.refuse_if_destroyed("barrier")
        self.check_not_capturing("barrier")  # a host wait: the backends without graphs refuse it in a capture
        self._barrier()

    def _barrier(self) -> None:
        """The backend's barrier (``barrier`` checked the backend first). This one: a timed host
        exchange (``HostCollectives``); the compiled backends meet on the device instead."""
        self._host.barrier(where="barrier")

    def destroy(self) -> None:
        """Release communication resources; the backend is unusable afterwards (its ops raise RuntimeError).
        Subclasses release their own resources and call this."""
        self.destroyed = True
        self._host.release()  # its gloo twin, if it has one, goes with its last owner

    def refuse_if_destroyed(self, op: str) -> None:
        """RuntimeError for an op on a destroyed backend, before it touches any resource."""
        if self.destroyed:
            raise RuntimeError(f"ep_plugin {self.name}: {op} on a backend that was destroyed (destroy()); build a "
                               "new one")

    def check_usable(self) -> None:
        """Raise ``EPError`` at once when an earlier op of this backend failed in a way that leaves it out of
        step with its peers (a timed-out collective): another op would wait out a timeout instead."""
        self._host.check_usable()

    def _wait_for_host(self, what: str) -> None:
        """Host wait, with the timeout, until the current stream has run what was queued so far
        (backends whose kernels report failures from the device override it to raise that report)."""
        if self.device.type == "cuda":
            streams.wait_for_stream(self.device, self.config.timeout_s, f"ep_plugin {self.name}: rank {self.rank}: "
                                    f"{what}")

    # ---- byte model (for benchmarks) -------------------------------------------------------------

    @classmethod
    def wire_bytes(cls, routing_maps: list[torch.Tensor], num_ranks: int, *, row_bytes: int, hidden: int, topk: int,
                   with_probs: bool, **options) -> dict[str, list[int]]:
        """What this backend moves for these routing maps (host arithmetic, no communication).

        Args:
            routing_maps: every rank's [T, E] bool routing map (host tensors), indexed by rank.
            row_bytes: bytes of one dispatched token (bf16: 2H; fp8: H + scales); hidden: H.
            topk: experts per token; with_probs: probs travel (dispatch: the routing probs; combine:
                per-row values back, as in the backward); options: the dispatch options.
        Returns: {"out_rows": rows of each rank's dispatch output, "dispatch": bytes each rank sends to
            other ranks, "combine": the same for combine (bf16 rows back)}; a rank's bytes to itself are
            not counted.

        This base model is an all-to-all of expanded rows: one row per (token, remote expert) each way,
        plus 4 bytes of prob per row where probs travel. Backends with another wire format override it.
        """
        packets, rows = route_counts(routing_maps, num_ranks)
        probs = 4 if with_probs else 0
        return cls._wire_totals(rows, rows, row_bytes + probs, 2 * hidden + probs)

    @staticmethod
    def _wire_totals(out_units: list[list[int]], link_units: list[list[int]], dispatch_unit: int,
                     combine_unit: int) -> dict[str, list[int]]:
        """Sum per-(source, destination) unit counts into per-rank totals (combine flows back)."""
        num_ranks = len(out_units)
        totals = {"out_rows": [0] * num_ranks, "dispatch": [0] * num_ranks, "combine": [0] * num_ranks}
        for source in range(num_ranks):
            for dest in range(num_ranks):
                totals["out_rows"][dest] += out_units[source][dest]
                if dest != source:
                    totals["dispatch"][source] += link_units[source][dest] * dispatch_unit
                    totals["combine"][dest] += link_units[source][dest] * combine_unit
        return totals

    # ---- shared checks ------------------------------------------------------------------

    def check_not_capturing(self, op: str) -> None:
        """Refuse, before anything is enqueued, an op that a CUDA graph being captured cannot hold: a
        blocking dispatch (it reads the row count on the host), a barrier (it waits on the host) or any op
        of a backend that does not claim graphs. The capture would otherwise fail inside the op with
        CUDA's own error."""
        if self.device.type != "cuda":
            return
        reads_host = op == "barrier" or op == "dispatch" and self.config.blocking
        if self.capabilities.cuda_graphs and not reads_host or not torch.cuda.is_current_stream_capturing():
            return
        if not self.capabilities.cuda_graphs:
            why = "does not support CUDA graphs (hybrid and elastic in non-blocking mode do)"
        elif op == "barrier":
            why = "waits on the host for its peers in a barrier, which a graph cannot hold; call it outside the capture"
        else:
            why = ("reads its row count on the host in blocking mode; set EP_PLUGIN_BLOCKING=0 (outputs sized to "
                   "num_permuted_tokens, no host sync) to capture it")
        raise RuntimeError(f"ep_plugin {self.name}: {op} inside a CUDA graph capture: this backend {why}")

    def check_routing_form(self, routing_map, topk_idx) -> None:
        """ValueError, before any communication, for a routing form this backend does not take
        (``capabilities.routing_forms``; elastic takes top-k ids only)."""
        if routing_map is not None and "routing_map" not in self.capabilities.routing_forms:
            raise ValueError(f"backend {self.name!r} takes topk_idx (+ topk_weights), not routing_map; top-k ids "
                             "come from routing_map.int().topk(k) where every row has k experts")
        if routing_map is None and topk_idx is not None and "topk" not in self.capabilities.routing_forms:
            raise ValueError(f"backend {self.name!r} takes routing_map (+ probs), not topk_idx")

    def check_dispatch_input(self, hidden, *, routing_map, probs, topk_idx, topk_weights, pad_multiple):
        self.check_routing_form(routing_map, topk_idx)
        if isinstance(hidden, (tuple, list)):
            hidden = self.check_fp8_hidden(hidden)
        else:
            self.check_hidden("hidden", hidden, None)
        if hidden.shape[0] > self.config.max_tokens_per_rank and not self.refuses_input_in_exchange:
            raise ValueError(self._over_budget(hidden.shape[0]))
        pad_multiple = self.config.pad_multiple if pad_multiple is None else pad_multiple
        check_pad_multiple(pad_multiple)
        routing, weights = make_routing(
            hidden, self.num_experts, routing_map=routing_map, probs=probs, topk_idx=topk_idx,
            topk_weights=topk_weights, probs_dtypes=self.capabilities.probs_dtypes,
            check_values=self._reads_ids_on_host())
        return routing, weights, pad_multiple

    def _reads_ids_on_host(self) -> bool:
        """Whether dispatch range- and repeat-checks top-k ids with a host read before the op: not where
        the kernels check them, nor where the op's exchange carries the verdict, nor in sync-free mode."""
        return not self.checks_ids_on_device and not self.refuses_input_in_exchange and not self._sync_free()

    def _over_budget(self, num_tokens: int) -> str:
        """Why this rank refuses a dispatch of ``num_tokens`` tokens (``_too_many_tokens``: its peers' words)."""
        return (f"hidden has {num_tokens} tokens, over max_tokens_per_rank={self.config.max_tokens_per_rank} "
                f"(raise it with EP_PLUGIN_MAX_TOKENS_PER_RANK, equal on every rank)")

    def _too_many_tokens(self) -> str:
        """What a peer passed whose dispatch was refused for its token count (every rank's message)."""
        return f"more tokens than max_tokens_per_rank={self.config.max_tokens_per_rank} (EP_PLUGIN_MAX_TOKENS_PER_RANK)"

    def _refused_input(self, routing: Routing) -> Optional[str]:
        """Why this rank's dispatch input is refused (more tokens than ``max_tokens_per_rank``, a top-k id out
        of range, an expert twice), or None; for a backend that ``refuses_input_in_exchange``. The ids take
        a host read, so they are not checked in sync-free mode."""
        if routing.num_tokens > self.config.max_tokens_per_rank:
            return self._over_budget(routing.num_tokens)
        if routing.form != TOPK or self._sync_free():
            return None
        try:
            check_topk_values(routing.topk_idx, self.num_experts)
        except ValueError as error:
            return str(error)
        return None

    def _sync_free(self) -> bool:
        """Whether ops avoid host syncs: a backend without a sync-free mode (the reference) runs blocking
        whatever ``config.blocking`` says. (Across domains the rails follow ``config.blocking`` whatever the
        domain backend: a reference domain with blocking=False moves fixed rail blocks, which is how the CPU
        tests cover the sync-free rail protocol, and slower than its blocking rails.)"""
        return not self.config.blocking and self.capabilities.non_blocking

    def check_hidden(self, name: str, hidden: torch.Tensor, num_rows: Optional[int]) -> None:
        check_tensor(name, hidden, dtypes=self.capabilities.hidden_dtypes, ndim=2, device=self.device)
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"{name} has hidden size {hidden.shape[1]}, but this {self.name} backend was built for "
                             f"hidden_size={self.hidden_size}")
        if num_rows is not None and hidden.shape[0] != num_rows:
            raise ValueError(f"{name} has {hidden.shape[0]} rows; the handle expects {num_rows}")

    FP8_BLOCK = 128  # elements per fp32 scale of an FP8 dispatch payload

    def check_fp8_hidden(self, hidden) -> torch.Tensor:
        """Validate an FP8 dispatch input ``(data [T, H] float8_e4m3fn, scales [T, H/128] float32)``.

        Returns the data tensor (for the shape checks that follow).
        """
        if not self.capabilities.fp8_dispatch:
            raise TypeError(f"backend {self.name!r} does not take FP8 input; pass hidden as one tensor")
        if len(hidden) != 2:
            raise ValueError(f"FP8 hidden must be a (data, scales) pair, got {len(hidden)} items")
        data, scales = hidden
        check_tensor("hidden[0] (fp8 data)", data, dtypes=(torch.float8_e4m3fn,), ndim=2, device=self.device)
        if data.shape[1] != self.hidden_size:
            raise ValueError(f"hidden[0] has hidden size {data.shape[1]}, but this {self.name} backend was built for "
                             f"hidden_size={self.hidden_size}")
        if self.hidden_size % self.FP8_BLOCK:
            raise ValueError(f"FP8 dispatch needs hidden_size divisible by {self.FP8_BLOCK}, got {self.hidden_size}")
        check_tensor("hidden[1] (fp8 scales)", scales, dtypes=(torch.float32,),
                     shape=(data.shape[0], self.hidden_size // self.FP8_BLOCK), device=self.device)
        return data

    def check_cached_input(self, hidden, handle: Handle) -> torch.Tensor:
        """Validate the input of a cached dispatch (``dispatch(hidden, handle=...)``): the handle, and
        [T, H] rows (or an FP8 pair) with the handle's T. Returns the data tensor."""
        self.check_handle(handle)
        if not isinstance(hidden, (tuple, list)):
            self.check_hidden("hidden", hidden, handle.num_tokens)
            return hidden
        if self.capabilities.fp8_dispatch and not self.capabilities.cached_fp8:
            raise TypeError(f"backend {self.name!r} takes FP8 rows in a routed dispatch only; a cached dispatch "
                            "(handle=...) takes one bf16 tensor")
        data = self.check_fp8_hidden(hidden)
        if data.shape[0] != handle.num_tokens:
            raise ValueError(f"hidden has {data.shape[0]} rows; the handle expects {handle.num_tokens}")
        return data

    def check_options(self, op: str, options: dict, known: tuple[str, ...]) -> None:
        if not options:  # the common case, on every op's host path
            return
        unknown = sorted(set(options) - set(known))
        if unknown:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            streams_instead = ""
            if set(unknown) & set(DEEPEP_STREAM_OPTIONS):
                streams_instead = (" (DeepEP's stream options: here an op runs on the caller's current stream, so "
                                   "issue it under torch.cuda.stream(s) for another, and out.use_on(stream) hands "
                                   "its outputs to a stream that reads them)")
            raise TypeError(f"backend {self.name!r} has no {op} option(s) {unknown}; {takes}{streams_instead}")

    @classmethod
    def shape_problem(cls, hidden_size: int, num_local_experts: int) -> Optional[str]:
        """What this backend cannot take about a layer's shape (its kernels' limits), or None. Asked when a
        backend is built, and by the Megatron integration at model build (before the first step)."""
        return None

    @classmethod
    def topk_problem(cls, experts_per_token: int) -> Optional[str]:
        """Whether this backend's kernels cannot take tokens routed to ``experts_per_token`` experts (backends that
        take top-k ids have a widest k, ``MAX_TOPK``), or None. Asked, like ``shape_problem``, before any rank
        builds one (the demo, the Megatron integration)."""
        widest = getattr(cls, "MAX_TOPK", None)
        if widest is None or experts_per_token <= widest:
            return None
        return f"backend {cls.name!r} takes at most {widest} experts per token, got {experts_per_token}"

    def dispatch_form(self, form: str, **options) -> str:
        """The form a dispatch with these options names in its op fingerprint (``agreement``'s forms): the
        routing form, unless an option changes what the rows on the wire are (elastic's expand and
        in_place). The hierarchical backend asks its domain backend, so ranks that differ there disagree."""
        return form

    def check_dispatch_flags(self, **options) -> None:
        """The values of this backend's own dispatch options (``check_options`` checks their names), a cached
        dispatch's too, before any communication. None by default; the hierarchical backend asks its domain
        backend's."""
        return None

    def check_handle(self, handle: Handle) -> None:
        if not isinstance(handle, Handle):
            raise TypeError(f"expected an ep_plugin Handle, got {type(handle).__name__}")
        if handle.backend is not self:
            raise ValueError("this handle belongs to another backend instance")

    # ---- what each backend implements ---------------------------------------------------

    @abc.abstractmethod
    def _dispatch(self, hidden: torch.Tensor, routing: Routing, probs: Optional[torch.Tensor],
                  pad_multiple: int, **options) -> DispatchOutput: ...

    @abc.abstractmethod
    def _dispatch_again(self, hidden: torch.Tensor, handle: Handle) -> torch.Tensor: ...

    @abc.abstractmethod
    def _combine(self, rows: torch.Tensor, handle: Handle, row_probs: Optional[torch.Tensor],
                 **options) -> CombineOutput: ...

    def _cached_dispatch(self, hidden, handle: Handle, **form) -> DispatchOutput:
        """``dispatch(hidden, handle=...)``, by default the backward of combine (``_dispatch_again``); a
        backend with FP8 or form options of its own (``capabilities.cached_*``) overrides it."""
        self.check_cached_input(hidden, handle)
        return DispatchOutput(self._dispatch_again(hidden, handle), None, handle.tokens_per_expert, handle,
                              num_valid_rows=self._valid_rows_of(handle), ready=self._ready())

    def _valid_rows_of(self, handle: Handle) -> Optional[torch.Tensor]:
        """The ``num_valid_rows`` of a cached dispatch along ``handle``: None where every row is valid."""
        return None

    def _ready(self) -> Optional[torch.cuda.Event]:
        """An output's ``ready`` event: None on the CPU, where an op has finished when it returns."""
        return streams.record_ready(self.device) if self.device.type == "cuda" else None
