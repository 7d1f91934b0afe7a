"""What all ranks must agree on, and the words that tell them apart when they do not.

Two checks keep ranks that disagree from crashing inside a collective or returning wrong rows:

- When a backend is built, every rank contributes the fields that shape the wire format
  (hidden size, expert count, token budget, ...); ``check_construction`` gathers them once and
  raises ``ValueError`` on every rank naming each field that differs and every rank's value.
- Every op carries a fingerprint packed into 63 bits (``OpFingerprint.pack``): op kind, payload dtype, probs
  present, routing form, top-k width, whether autograd recorded the op (its backward will run),
  whether a dispatch's probs need a gradient (its backward routes them back) and the handle the op
  uses. The compiled backends publish it with their device handshake; ``reference`` exchanges it with
  its counts. A rank that sees a different fingerprint from a peer raises ``EPError``
  (``mismatch_message`` names the op, the fields, both ranks and their values).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .config import Config
from .errors import EPError
from .host_collectives import SETUP_EXCHANGE, HostCollectives

# Op kinds; the code is part of the fingerprint.
OP_DISPATCH = "dispatch"
OP_COMBINE = "combine"
OP_DISPATCH_AGAIN = "dispatch_again"  # cached dispatch along a handle (backward of combine)
OP_BARRIER = "barrier"
OP_COMBINE_IN_PLACE = "combine_in_place"  # combine whose rows the sources read in the experts' buffers
OP_SETUP = "setup"  # not an op: a setup call's host exchange (host_collectives.SETUP_EXCHANGE)
_OPS = (None, OP_DISPATCH, OP_COMBINE, OP_DISPATCH_AGAIN, OP_BARRIER, OP_COMBINE_IN_PLACE, OP_SETUP)

_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn)
# "topk+expand": a top-k dispatch that delivers expanded (expert-grouped) rows: its wire carries more.
# "topk+in_place": a top-k dispatch whose sources write the rows into the receivers' buffers.
_FORMS = (None, "routing_map", "topk", "topk+expand", "topk+in_place")

# Bit widths of the packed fields, low bits first. 63 bits in all, so the packed value is a
# non-negative signed 64-bit integer on every side (Python, torch int64, CUDA u64).
# topk's 10 bits take any top-k of up to 1023 experts apart (7 bits made k=128 and k=200 look alike);
# handle_id's 41 bits last 2 * 10^12 dispatches.
_LAYOUT = (("op", 3), ("dtype", 3), ("probs", 1), ("form", 3), ("topk", 10), ("grad", 1), ("probs_grad", 1),
           ("handle_id", 41))
# The widest top-k the fingerprint tells apart; a wider one is packed as this.
TOPK_FIELD_MAX = (1 << dict(_LAYOUT)["topk"]) - 1


_LOW_BITS = sum(bits for _, bits in _LAYOUT[:-1])  # the fields below handle_id
_PACKED_LOW_FIELDS: dict[tuple, int] = {}  # (op, dtype, probs, form, topk, grad, probs_grad) -> packed bits


def _pack_codes(codes: dict[str, int], layout: tuple[tuple[str, int], ...]) -> int:
    value, shift = 0, 0
    for name, bits in layout:
        code = codes[name]
        if not 0 <= code < (1 << bits):
            raise ValueError(f"op fingerprint field {name}={code} does not fit in {bits} bits")
        value |= code << shift
        shift += bits
    return value


@dataclass(frozen=True)
class OpFingerprint:
    """The per-op facts that every rank must share.

    op: one of dispatch / combine / dispatch_again / barrier / combine_in_place.
    dtype: payload dtype (None when the op carries no payload dtype of its own).
    probs: whether probs / weights travel with the op.
    form: routing form of a dispatch ("routing_map" or "topk"), else None.
    topk: top-k width of a top-k dispatch (0 otherwise), at most TOPK_FIELD_MAX.
    grad: autograd recorded the op (``ep_plugin.dispatch``/``combine`` with inputs that need grad, grad
        mode on), so its backward will run on this rank. A rank without it would never enter that
        backward and leave the others waiting in it; differing here is an error at the forward instead.
    probs_grad: a recorded dispatch whose probs (or top-k weights) need a gradient: its backward routes
        the per-row gradients back with the rows. Ranks that differ would meet in that backward with
        different ops; differing here is an error at the forward instead.
    handle_id: which dispatch's handle a combine / dispatch_again uses (its per-backend dispatch
        number, counted from 1; 0 for a dispatch). Ranks that use their handles in different
        orders differ here.
    """

    op: Optional[str]
    dtype: Optional[torch.dtype] = None
    probs: bool = False
    form: Optional[str] = None
    topk: int = 0
    handle_id: int = 0
    grad: bool = False
    probs_grad: bool = False

    def pack(self) -> int:
        return fingerprint_code(self.op, self.dtype, self.probs, self.form, self.topk, self.handle_id, self.grad,
                                self.probs_grad)

    @classmethod
    def unpack(cls, value: int) -> "OpFingerprint":
        codes, shift = {}, 0
        for name, bits in _LAYOUT:
            codes[name] = (value >> shift) & ((1 << bits) - 1)
            shift += bits

        def pick(table, code):  # an unknown code (corrupt value) reads as None, never raises
            return table[code] if code < len(table) else None

        return cls(op=pick(_OPS, codes["op"]), dtype=pick(_DTYPES, codes["dtype"]), probs=bool(codes["probs"]),
                   form=pick(_FORMS, codes["form"]), topk=codes["topk"], handle_id=codes["handle_id"],
                   grad=bool(codes["grad"]), probs_grad=bool(codes["probs_grad"]))


def fingerprint_code(op: Optional[str], dtype: Optional[torch.dtype] = None, probs: bool = False,
                     form: Optional[str] = None, topk: int = 0, handle_id: int = 0, grad: bool = False,
                     probs_grad: bool = False) -> int:
    """``OpFingerprint(...).pack()`` without building the dataclass (~4 µs): what the compiled
    backends' kernels take, on every op's host path."""
    # The fields but handle_id take few values, so their packed bits are remembered (a dict
    # lookup instead of ~3 µs of loop).
    key = (op, dtype, probs, form, topk, grad, probs_grad)
    low = _PACKED_LOW_FIELDS.get(key)
    if low is None:
        low = _PACKED_LOW_FIELDS[key] = _pack_codes(
            {"op": _OPS.index(op), "dtype": _DTYPES.index(dtype), "probs": int(probs), "form": _FORMS.index(form),
             "topk": topk, "grad": int(grad), "probs_grad": int(probs_grad)}, _LAYOUT[:-1])
    if not 0 <= handle_id < (1 << _LAYOUT[-1][1]):
        raise ValueError(f"op fingerprint field handle_id={handle_id} does not fit in {_LAYOUT[-1][1]} bits")
    return low | handle_id << _LOW_BITS


# The rule every disagreement message ends with.
WHAT_RANKS_SHARE = ("All ranks must issue the same ops in the same order with the same dtype, probs, routing form, "
                    "handles and grad (of the inputs and of the probs).")


def ordinal(number: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 21st: which backend built on a group (messages)."""
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


# The setup word is a fingerprint no op has, so an op's opening exchange that meets it knows what it met.
assert fingerprint_code(OP_SETUP) == SETUP_EXCHANGE


def mismatch_message(backend: str, rank: int, peer: int, mine: int, theirs: int,
                     rank_name: Callable[[int], str] = "rank {}".format) -> str:
    """Name the op, every field that differs, both ranks and their values.

    ``rank_name`` names a rank of the group: ``HostCollectives.peer_name`` adds the global rank in a
    subgroup (Megatron's EP group), whose own numbers send users to another process's log.
    """
    a, b = OpFingerprint.unpack(mine), OpFingerprint.unpack(theirs)
    me, them = rank_name(rank), rank_name(peer)
    differing = [f.name for f in fields(OpFingerprint) if getattr(a, f.name) != getattr(b, f.name)]
    details = "; ".join(f"{name}: {getattr(a, name)!r} on {me}, {getattr(b, name)!r} on {them}"
                        for name in differing)
    op = a.op if a.op == b.op else f"{a.op} ({me}) / {b.op} ({them})"
    if "grad" in differing:  # the one field a user does not pass: say where it comes from
        details += (" (grad: autograd recorded the op, so its backward will run; the inputs need grad on some "
                    "ranks only, or some ranks run under torch.no_grad)")
    if "probs_grad" in differing:
        details += (" (probs_grad: the probs or top-k weights need a gradient on some ranks only; its backward "
                    "would route them back there only)")
    return f"ep_plugin {backend}: ranks disagree on {op}: {details or 'fingerprints differ'}. {WHAT_RANKS_SHARE}"


def met_a_setup_step_error(backend: str, me: str, where: str, peers: list[str], on: str) -> EPError:
    """An op's opening exchange met ``peers`` in a setup step (their word was ``SETUP_EXCHANGE``): one frame
    size for both, so no abort, but the ranks issued different calls. ``on``: "this process group", or the
    domain level of a backend across domains."""
    return EPError(f"ep_plugin {backend}: {me} ran {where} while {', '.join(peers)} were in a setup step on {on} "
                   "(building or destroying a backend; their own messages name it): the ranks issued different "
                   "calls (an op on some ranks only, or a backend built or destroyed on some ranks only).")


def check_construction(group: Optional[dist.ProcessGroup], backend: str, facts: dict[str, Any], *,
                       timeout_s: Optional[float] = None, device: Optional[torch.device] = None,
                       on_host: bool = True) -> None:
    """Raise ValueError on every rank unless every rank of ``group`` passed equal ``facts``.

    One gather of a small dict (two small all-to-alls); call it where the backend is built (a
    collective). A rank that does not arrive within ``timeout_s`` (default: the config's) makes
    the others raise ``EPTimeoutError`` naming it; an engine failure raises ``EPError``.
    ``on_host``: over NCCL, gather on the group's gloo twin (``HostCollectives``).
    """
    if timeout_s is None:
        timeout_s = Config.from_env().timeout_s
    collectives = HostCollectives(group, owner=f"ep_plugin {backend}", timeout_s=timeout_s, label="construction",
                                  device=device, on_host=on_host)
    gathered = collectives.all_gather_object(facts, where=f"building the {backend} backend (agreement check)")
    # Every rank judges the same gathered list the same way, so every rank raises, or none: over every rank's
    # fields, not this rank's alone, and a field one rank does not check is not one it checks as None.
    problems = []
    for name in sorted(set().union(*(g.keys() for g in gathered)), key=str):
        without = [r for r, g in enumerate(gathered) if name not in g]
        if without:
            checked = [r for r in range(len(gathered)) if r not in without]
            problems.append(f"{name} (checked on {_ranks(checked)} only, not on {_ranks(without)}: another "
                            f"ep_plugin version or backend class there)")
            continue
        values = [g[name] for g in gathered]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            problems.append(f"{name} ({per_rank})")
    if problems:
        raise ValueError(f"ep_plugin {backend}: ranks were built with different settings: " + "; ".join(problems))


def _ranks(ranks: list[int]) -> str:
    """'rank 2' or 'ranks 0, 1'."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
