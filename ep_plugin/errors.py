"""Exception types raised by ep_plugin. Bad input raises the built-in TypeError/ValueError."""


class EPError(RuntimeError):
    """A failure inside ep_plugin (CUDA call, communication, backend state)."""


class EPTimeoutError(EPError, TimeoutError):
    """A wait ran past ``Config.timeout_s``; the message names rank, phase, peer and counters."""


class BackendUnavailableError(EPError):
    """The backend cannot run here (no compiled extension, no GPU, unsupported device)."""
