"""Exception types raised by ep_plugin. Bad input raises the built-in TypeError/ValueError."""


class EPError(RuntimeError):
    """A failure inside ep_plugin (CUDA call, communication, backend state)."""


class EPTimeoutError(EPError, TimeoutError):
    """A wait ran past ``Config.timeout_s``; the message names rank, phase, peer and counters."""


class BackendUnavailableError(EPError):
    """The backend cannot run here (no compiled extension, no GPU, unsupported device)."""


class TooManyTokensError(ValueError):
    """Every rank refused a dispatch because some rank passed more tokens than the backend holds
    (``Config.max_tokens_per_rank``), and for no other reason. Raised on every rank alike, before any row
    moved: the backend stays usable, and a caller may build a larger one together and dispatch again
    (the Megatron integration does)."""
