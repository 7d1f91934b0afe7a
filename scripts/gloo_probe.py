"""Which tensors gloo's all_to_all_single moves here (CPU, and CUDA when there is a GPU).

    python scripts/gloo_probe.py            # 2 ranks; one line per (device, dtype): ok / refused (message)

The scale-out engine (ep_plugin/transport/scaleout.py) moves every rail payload as uint8 rows and
stages CUDA tensors through host memory on a gloo rail; this says whether the staging could go.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_plugin.testing import run_ranks

DTYPES = (torch.uint8, torch.bool, torch.int64, torch.float32, torch.bfloat16, torch.float8_e4m3fn)


def probe(ctx) -> list[tuple[str, str, str]]:
    devices = ["cpu"] + ([ctx.device] if ctx.device != "cpu" else [])
    results = []
    group = dist.new_group(backend="gloo")  # gloo even where the world is NCCL
    for device in devices:
        for dtype in DTYPES:
            sent = torch.full((4,), ctx.rank + 1, dtype=torch.float32, device=device).to(dtype)
            received = torch.empty_like(sent)
            try:
                dist.all_to_all_single(received, sent, [2, 2], [2, 2], group=group)
                expected = torch.tensor([1, 1, 2, 2], dtype=torch.float32, device=device).to(dtype)
                same = torch.equal(received.view(torch.uint8), expected.view(torch.uint8))
                results.append((device, str(dtype), "ok" if same else "wrong values"))
            except Exception as exc:  # noqa: BLE001 - reported
                results.append((device, str(dtype), f"refused ({str(exc).splitlines()[0][:100]})"))
    return results


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for row in run_ranks(probe, 2, device=device, timeout_s=120)[0]:
        print(" ".join(row))
