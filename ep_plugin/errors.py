"""Exception types raised by ep_plugin. Bad input raises the built-in TypeError/ValueError."""


class EPError(RuntimeError):
    """A failure inside ep_plugin (CUDA call, communication, backend state)."""


class EPTimeoutError(EPError, TimeoutError):
    """A wait ran past ``Config.timeout_s``; the message names rank, phase, peer and counters."""


class BackendUnavailableError(EPError):
    """The backend cannot run here (no compiled extension, no GPU, unsupported device)."""


class TooManyTokensError(ValueError):
    """Every rank refused a dispatch because some rank passed more tokens than the backend holds
    (``Config.max_tokens_per_rank``), and no rank's input was refused for another reason (a rank over the
    count is refused for that alone: its top-k ids are checked when it dispatches again). Raised on every
    rank alike, before any row was delivered, by the backends that refuse in the op's first exchange (all
    of them in blocking mode; a sync-free compiled backend refuses on that rank alone, with ValueError): the
    backend stays usable, and a caller may build a larger one together and dispatch again (the Megatron
    integration does)."""


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+: shown under the message); on 3.10 the note joins the message."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.args = (f"{error}\n{note}",)
