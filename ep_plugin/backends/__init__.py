"""Backends: ``reference`` (torch.distributed oracle), ``hybrid`` (CUDA, one NVLink domain)."""

from .base import Backend, Capabilities

__all__ = ["Backend", "Capabilities"]
