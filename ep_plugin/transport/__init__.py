"""Transports: ``ipc`` (CUDA IPC buffers within one NVLink domain / one GPU)."""
