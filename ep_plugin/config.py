"""Every knob of ep_plugin in one dataclass, each with an ``EP_PLUGIN_<NAME>`` env override.

Precedence: explicit keyword arguments > environment variables > defaults. A variable set to an
empty value counts as unset.
``Config.from_env()`` is what backends use when the caller passes no config.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from .logs import count_as_given, warn_once

ENV_PREFIX = "EP_PLUGIN_"
# Variables of the build and the test bed, not knobs: setup.py and tests/conftest.py read them.
OTHER_VARIABLES = ("EP_PLUGIN_CUDA_ARCHS", "EP_PLUGIN_NO_CUDA", "EP_PLUGIN_NVCC_FLAGS", "EP_PLUGIN_REQUIRE_GPU")

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# The longest wait (about 11.6 days): far beyond any job's patience, and far below where the engines'
# own timeouts break (gloo's wait hangs or fails at once past ~9e9 s: nanoseconds overflow int64).
MAX_TIMEOUT_S = 1e6
# The shortest: the engines count a timeout in whole milliseconds, and gloo reads 0 ms as "no timeout".
MIN_TIMEOUT_S = 1e-3

# The largest expert-segment padding (quantized formats pad to 16..128 rows; far larger pads would
# overflow the kernels' 32-bit row counts long before they made sense).
MAX_PAD_MULTIPLE = 1 << 16


@dataclass(frozen=True)
class Config:
    """Runtime configuration shared by all backends.

    Each field's env override is ``EP_PLUGIN_`` + the upper-cased field name
    (for example ``EP_PLUGIN_TIMEOUT_S=5``). The README has the full table.
    """

    # Seconds any wait (device spin-wait, host wait on a count, a host collective) may take
    # before it reports rank / phase / peer and raises instead of hanging.
    timeout_s: float = field(default=100.0, metadata={"help": "seconds before a wait reports and raises"})
    # Largest number of tokens one rank may pass to dispatch; communication buffers are sized from it.
    max_tokens_per_rank: int = field(default=8192, metadata={"help": "largest T per rank per call"})
    # Thread blocks (one per SM) each rank's communication kernels may use; 0 = autosize from the fabric
    # (transport.sizing.resolve_num_sms). 16 stays the default: it is the measured best on the test bed.
    num_sms: int = field(default=16, metadata={"help": "SMs per rank for dispatch/combine kernels (0 = autosize)"})
    # Default padding of each expert segment in the dispatch output.
    pad_multiple: int = field(default=1, metadata={"help": "default expert-segment padding"})
    # Non-blocking mode: rows reserved for the permuted dispatch output (0 = worst case).
    num_permuted_tokens: int = field(default=0, metadata={"help": "non-blocking output budget (0 = worst case)"})
    # Blocking mode reads the exact output size on the host; non-blocking never syncs.
    blocking: bool = field(default=True, metadata={"help": "exact-size output with one host read"})
    # No record_stream of the inputs our kernels read (it costs host time): the caller keeps them alive
    # until the op's stream has run them.
    avoid_record_stream: bool = field(default=False, metadata={
        "help": "no record_stream of inputs: the caller keeps them alive"})
    # GPU copy engine of the hybrid backend: bulk (TMA) copies on sm_90+, else 16-byte register copies.
    bulk_copy: bool = field(default=True, metadata={"help": "bulk (TMA) copies where the GPU has them"})
    # Refuse launches whose resident blocks across ranks sharing a GPU would exceed this many SMs (0 = detect).
    max_sms_per_gpu: int = field(default=0, metadata={"help": "SMs a GPU offers to co-resident ranks (0 = detect)"})
    # Ranks per NVLink domain (scale-up). 0 = detect from placement (ranks on one host that can map
    # each other's GPU memory; on CPU every rank is its own domain). A smaller value splits the world
    # into more domains joined by the scale-out rails (ep_plugin.topology), e.g. to test that path on one host.
    scaleup_size: int = field(default=0, metadata={"help": "ranks per NVLink domain (0 = detect from placement)"})
    # hybrid: rows of combine input its buffer's combine-input arena has room for (0 = no arena). An
    # expert output allocated there (combine_input(), combine_input_arena(), or Megatron's experts) is
    # combined in place: the sources read the rows where they are, in one pass. Equal on every rank.
    combine_input_rows: int = field(default=0, metadata={
        "help": "hybrid: rows of expert output its combine-input arena holds (0 = none; combine in place)"})
    # Scale-out chunk: tokens the rail exchange moves per collective (0 = all in one). DeepEP's
    # kScaleoutUpdateInterval (tokens before a scale-out warp publishes its tail) is the same knob for an
    # engine with in-kernel puts: 6 -> 16 cut time by 22% on EFA. Equal on every rank (it shapes the wire).
    scaleout_chunk_tokens: int = field(default=0, metadata={
        "help": "tokens (rows) per rail peer in one scale-out collective; 0 = one collective per op"})
    # SMs of a rank given to forwarding between the rail and the NVLink domain (0 = same as num_sms). The
    # forwarding runs inside the domain backend's kernels today, so this caps num_sms of that backend.
    forward_sms: int = field(default=0, metadata={
        "help": "SMs for forwarding rail traffic into the domain (0 = num_sms)"})
    # The watch on the peers' processes (those on this host): a device wait for a rank whose process
    # exited stops at once with a message saying so, instead of timing out after timeout_s
    # (ep_plugin.transport.liveness). The kernel signals an exit through a pidfd; where there is none,
    # the watch looks every peer_watch_s seconds. 0 = no watch.
    peer_watch_s: float = field(default=0.5, metadata={
        "help": "watch the peers' processes on this host; seconds between looks where no pidfd (0 = off)"})
    # The small words the host reads (the setup's: construction check, topology, buffer handles; the
    # scale-out agreement's and counts) of an NCCL group on a gloo twin of it, so that a peer that never
    # arrives leaves no kernel waiting on a GPU (HostCollectives' on_host). Off: on the NCCL group itself,
    # for jobs where gloo cannot connect (the host then waits for the GPU to read them). Equal on every rank.
    gloo_host_words: bool = field(default=True, metadata={
        "help": "the host words of an NCCL group go over a gloo twin of it (False: over NCCL)"})

    def __post_init__(self) -> None:
        for knob in fields(self):
            self._check_type(knob)
        _require(MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S, "timeout_s",
                 f">= {MIN_TIMEOUT_S:g} s (engines count whole milliseconds) and <= {MAX_TIMEOUT_S:.0e} s",
                 self.timeout_s)
        _require(self.max_tokens_per_rank >= 1, "max_tokens_per_rank", ">= 1", self.max_tokens_per_rank)
        _require(0 <= self.num_sms <= 1024, "num_sms", "in [0, 1024] (0 = autosize)", self.num_sms)
        _require(1 <= self.pad_multiple <= MAX_PAD_MULTIPLE, "pad_multiple", f"in [1, {MAX_PAD_MULTIPLE}]",
                 self.pad_multiple)
        _require(self.num_permuted_tokens >= 0, "num_permuted_tokens", ">= 0", self.num_permuted_tokens)
        _require(self.max_sms_per_gpu >= 0, "max_sms_per_gpu", ">= 0", self.max_sms_per_gpu)
        _require(self.combine_input_rows >= 0, "combine_input_rows", ">= 0 (0 = no arena)", self.combine_input_rows)
        _require(self.scaleup_size >= 0, "scaleup_size", ">= 0 (0 = detect)", self.scaleup_size)
        _require(self.scaleout_chunk_tokens >= 0, "scaleout_chunk_tokens", ">= 0 (0 = no chunking)",
                 self.scaleout_chunk_tokens)
        _require(0 <= self.forward_sms <= 1024, "forward_sms", "in [0, 1024] (0 = num_sms)", self.forward_sms)
        _require(0 <= self.peer_watch_s < math.inf, "peer_watch_s", ">= 0 and finite (0 = off)", self.peer_watch_s)

    def _check_type(self, knob) -> None:
        """A flag must be a bool (a string "no" would read as True), a count an int (2.0 or True would
        pass the range checks and fail later, at a launch), a float field a real number; an int passed
        as a float (``timeout_s=5``) is stored as one."""
        value, kind = getattr(self, knob.name), knob.type if isinstance(knob.type, str) else knob.type.__name__
        if kind == "bool":
            _require(isinstance(value, bool), knob.name, "True or False", value)
        elif kind == "int":
            _require(isinstance(value, numbers.Integral) and not isinstance(value, bool), knob.name, "an int", value)
            object.__setattr__(self, knob.name, int(value))
        elif kind == "float":
            _require(isinstance(value, numbers.Real) and not isinstance(value, bool), knob.name, "a number", value)
            try:
                as_float = float(value)
            except OverflowError:  # an int past float's range (10**400): no bound below can take it either
                as_float = math.inf if value > 0 else -math.inf
            object.__setattr__(self, knob.name, as_float)

    @classmethod
    def from_env(cls, environ: Optional[dict] = None, **overrides: Any) -> "Config":
        """Build a Config from defaults, then ``EP_PLUGIN_*`` variables, then ``overrides``."""
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = set(overrides) - set(known)
        if unknown:
            raise TypeError(f"Config has no field(s) {sorted(unknown)}; known fields: {sorted(known)}")
        values: dict[str, Any] = {}
        for variable, hint in unknown_variables(environ).items():  # once: from_env runs at every backend build
            warn_once(logger, _unknown_warning(variable), "ep_plugin: %s is not a knob and is ignored%s",
                      variable, hint)
        for name, f in known.items():
            env_name = env_var_name(name)
            if env_is_set(name, environ):
                values[name] = _parse(env_name, environ[env_name], f.type)
        from_environment = set(values) - set(overrides)
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigValueError as error:  # name the variable only where the value came from one
            if error.field in from_environment:
                raise ConfigValueError(f"{error} (from {env_var_name(error.field)})", error.field) from None
            raise

    @classmethod
    def of_what_parses(cls, environ: Optional[dict] = None, underneath: Optional[dict] = None) -> "Config":
        """The ``EP_PLUGIN_*`` variables that parse, each tried alone (a refused one stays at its default, or at
        ``underneath``'s value for it): for the exchange that tells a rank's peers why it refused to build,
        which must still run with the job's timeout and host-word engine (EP_PLUGIN_GLOO_HOST_WORDS), as
        theirs does."""
        environ = os.environ if environ is None else environ
        usable = dict(underneath or {})
        for knob in fields(cls):
            variable = env_var_name(knob.name)
            if env_is_set(knob.name, environ):
                try:
                    cls.from_env({variable: environ[variable]})
                except ValueError:
                    continue
                usable[variable] = environ[variable]
        try:
            return cls.from_env(usable)
        except ValueError:  # fields that parse alone and clash together: the defaults, then
            return cls()

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


def is_int(value: Any) -> bool:
    """A Python int, not a bool (True is an int, and would pass a range check as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def env_var_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def unknown_variables(environ: Optional[dict] = None) -> dict[str, str]:
    """EP_PLUGIN_* variables that name no knob (a typo such as EP_PLUGIN_NUM_SM would go unnoticed), each with
    a hint naming the closest knob or build variable ("" when none is close). Names are compared after the
    prefix, which every one shares (compared whole, any name came close to some knob)."""
    environ = os.environ if environ is None else environ
    known = [env_var_name(f.name) for f in fields(Config)] + list(OTHER_VARIABLES)
    suffixes = {name[len(ENV_PREFIX):]: name for name in known}
    unknown = {}
    for variable in sorted(environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable[len(ENV_PREFIX):], list(suffixes), n=1)
            unknown[variable] = f" (did you mean {suffixes[close[0]]}?)" if close else ""
    return unknown


def claim_unknown_variables(environ: Optional[dict] = None) -> dict[str, str]:
    """``unknown_variables``, for a command that lists them itself (info, doctor): from_env's warning for each
    counts as given, so that no name is said twice."""
    unknown = unknown_variables(environ)
    for variable in unknown:
        count_as_given(_unknown_warning(variable))
    return unknown


def _unknown_warning(variable: str) -> tuple[str, str]:
    return ("unknown variable", variable)


def env_is_set(field_name: str, environ: Optional[dict] = None) -> bool:
    """Whether the field's variable overrides its default: set and not blank (``docker -e NAME=`` or an
    empty export means "unset", never False or 0)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(env_var_name(field_name), "").strip())


def variables_set(environ: Optional[dict] = None) -> dict[str, str]:
    """The knobs' variables that are set (``env_is_set``), name -> value, sorted by name: what a run took from
    the environment (the build's and test bed's variables, and names no knob reads, change nothing it does)."""
    environ = os.environ if environ is None else environ
    return {env_var_name(f.name): environ[env_var_name(f.name)]
            for f in sorted(fields(Config), key=lambda f: f.name) if env_is_set(f.name, environ)}


def describe() -> list[tuple[str, str, str]]:
    """(env var, default, help) rows, for the README table and ``python -m ep_plugin info``."""
    return [(env_var_name(f.name), repr(f.default), f.metadata.get("help", "")) for f in fields(Config)]


class ConfigValueError(ValueError):
    """A knob out of its bounds; ``field`` names it (``Config.from_env`` adds the variable it came from)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled as it was made (the launcher brings a rank's back)
        return type(self), (str(self), self.field)


def _require(ok: bool, name: str, expected: str, actual: Any) -> None:
    if not ok:
        raise ConfigValueError(f"ep_plugin config: {name} must be {expected}, got {actual!r}", name)


def _parse(env_name: str, text: str, type_name: Any) -> Any:
    type_name = type_name if isinstance(type_name, str) else type_name.__name__
    try:
        if type_name == "bool":
            lowered = text.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError("expected one of 1/0/true/false/yes/no/on/off")
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
    except ValueError as exc:
        raise ValueError(f"ep_plugin config: cannot parse {env_name}={text!r} as {type_name}: {exc}") from None
    raise TypeError(f"ep_plugin config: unsupported field type {type_name} for {env_name}")
