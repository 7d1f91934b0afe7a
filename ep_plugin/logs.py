"""Warnings a process gives once: the checks behind them run at every backend build or every MoE
layer, and the same line repeated per layer or per build buries the rest of the log."""

from __future__ import annotations

import logging
from typing import Any, Hashable

_given: set[Hashable] = set()  # the keys of the warnings given in this process


def warn_once(logger: logging.Logger, key: Hashable, message: str, *args: Any) -> None:
    """``logger.warning(message, *args)`` the first time ``key`` is seen in this process, else nothing."""
    if key in _given:
        return
    _given.add(key)
    logger.warning(message, *args)


def count_as_given(key: Hashable) -> None:
    """Give no warning for ``key`` in this process: the caller says it another way (a command's own list)."""
    _given.add(key)


def forget_warnings() -> None:
    """Give every warning again (tests that check a warning whatever ran before them)."""
    _given.clear()
