"""Transports the compiled backends stand on.

- ``symmetric``: one symmetric buffer per rank within an NVLink domain (CUDA IPC handles, one
  host), the op sequence, the abort flag, the device report and the mailbox (csrc/transport.cu).
- ``placement``: which ranks share a physical GPU (co-residency limits).
- ``scaleout``: the rails between NVLink domains on torch.distributed (NCCL or gloo), their
  timed collectives, and the reorder of hierarchical results into the one-domain order.
"""
