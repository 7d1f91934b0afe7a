"""The main job: a small MoE model trained across N ranks through ep_plugin's dispatch/combine.

Each rank holds a replica of the router and E/N experts (two-layer MLPs). Tokens are
synthetic: every step each rank draws fresh inputs and learns to imitate a fixed random
teacher network. The router's gradients are summed over ranks (data parallel); expert
gradients arrive through combine's backward from every rank's tokens.

Default: 4 CPU ranks over gloo with the reference backend; with a GPU, the hybrid CUDA
backend when it is built (else reference), ranks sharing the GPU under MPS.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ep_plugin
from ep_plugin.testing import RankContext, run_ranks


@dataclass(frozen=True)
class DemoSpec:
    steps: int = 30
    tokens_per_rank: int = 256
    hidden_size: int = 64
    ffn_size: int = 128
    num_experts: int = 8
    topk: int = 2
    lr: float = 3e-3
    backend: str = "reference"
    seed: int = 0


class MoELayer(torch.nn.Module):
    """Router + this rank's experts; forward moves tokens with ep_plugin.dispatch/combine."""

    def __init__(self, spec: DemoSpec, backend, payload_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec, self.backend, self.payload_dtype = spec, backend, payload_dtype
        torch.manual_seed(spec.seed)  # identical router on every rank
        self.router = torch.nn.Linear(spec.hidden_size, spec.num_experts, device=device)
        torch.manual_seed(spec.seed + 1 + backend.rank)  # different experts per rank
        local = backend.num_local_experts
        self.w_in = torch.nn.Parameter(torch.randn(local, spec.hidden_size, spec.ffn_size, device=device) * 0.1)
        self.w_out = torch.nn.Parameter(torch.randn(local, spec.ffn_size, spec.hidden_size, device=device) * 0.1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing_map [T, E] bool, probs [T, E] float32): each token's top-k experts, weights renormalised."""
        scores = torch.softmax(self.router(x), dim=-1)
        top_scores, top_experts = scores.topk(self.spec.topk, dim=-1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_experts, True)
        probs = torch.zeros_like(scores).scatter(1, top_experts, top_scores)
        return routing_map, probs

    def expert(self, local_expert: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's expert ``local_expert`` (a two-layer MLP) on rows [N, H] float32."""
        return F.gelu(rows @ self.w_in[local_expert]) @ self.w_out[local_expert]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing_map, probs = self.route(x)
        out = ep_plugin.dispatch(self.backend, x.to(self.payload_dtype).contiguous(), routing_map=routing_map,
                                 probs=probs)
        segments = torch.split(out.hidden.float(), out.tokens_per_expert.tolist())
        expert_rows = [self.expert(e, seg) for e, seg in enumerate(segments)]
        rows = torch.cat(expert_rows) * out.probs.unsqueeze(1)
        return x + ep_plugin.combine(rows.to(self.payload_dtype), out.handle).float()


def teacher(x: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1000)
    hidden = x.shape[1]
    w1 = (torch.randn(hidden, hidden, generator=generator) / hidden**0.5).to(x.device)
    w2 = (torch.randn(hidden, hidden, generator=generator) / hidden**0.5).to(x.device)
    return x + torch.tanh(x @ w1) @ w2


def synthetic_tokens(spec: DemoSpec, step: int, rank: int, world_size: int) -> torch.Tensor:
    """[tokens_per_rank, hidden_size] float32 (CPU): the inputs ``rank`` draws at ``step``."""
    generator = torch.Generator().manual_seed(spec.seed * 7919 + step * world_size + rank)
    return torch.randn(spec.tokens_per_rank, spec.hidden_size, generator=generator)


def train(ctx: RankContext, spec: DemoSpec) -> list[float]:
    """Train for spec.steps on this rank; returns the global mean loss of every step."""
    torch.set_num_threads(1)
    device = torch.device(ctx.device)
    backend = ep_plugin.get_backend(spec.backend)(hidden_size=spec.hidden_size, num_experts=spec.num_experts,
                                                  device=device)
    payload_dtype = torch.bfloat16 if spec.backend == "hybrid" else torch.float32
    model = MoELayer(spec, backend, payload_dtype, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.lr)
    progress = _progress(ctx, spec)
    losses, start = [], time.perf_counter()
    for step in range(spec.steps):
        x = synthetic_tokens(spec, step, ctx.rank, ctx.world_size).to(device)
        loss = F.mse_loss(model(x), teacher(x, spec.seed)) / ctx.world_size
        optimizer.zero_grad()
        loss.backward()
        dist.all_reduce(model.router.weight.grad)
        dist.all_reduce(model.router.bias.grad)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss))
        tokens_per_s = spec.tokens_per_rank * ctx.world_size * (step + 1) / (time.perf_counter() - start)
        if progress is not None:
            progress.set_postfix(loss=f"{losses[-1]:.4f}", tokens_per_s=f"{tokens_per_s:,.0f}")
            progress.update()
            progress.write(f"step {step + 1:3d}  loss {losses[-1]:.5f}  tokens/s {tokens_per_s:,.0f}")
    if progress is not None:
        progress.close()
    backend.destroy()
    return losses


def _progress(ctx: RankContext, spec: DemoSpec):
    if ctx.rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=spec.steps, desc=f"MoE demo ({spec.backend}, {ctx.world_size} ranks, {ctx.device})",
                unit="step")


def default_device_and_backend() -> tuple[str, str]:
    if torch.cuda.is_available():
        from . import _cuda

        return "cuda", ("hybrid" if _cuda.available() else "reference")
    return "cpu", "reference"


def main(argv: list[str] | None = None) -> int:
    device, backend = default_device_and_backend()
    parser = argparse.ArgumentParser(prog="python -m ep_plugin demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="number of rank processes (default 4)")
    parser.add_argument("--steps", type=int, default=DemoSpec.steps)
    parser.add_argument("--backend", default=backend, help=f"one of {ep_plugin.list_backends()} (default {backend})")
    parser.add_argument("--device", default=device, choices=["cpu", "cuda"], help=f"default {device}")
    parser.add_argument("--tokens", type=int, default=DemoSpec.tokens_per_rank, help="tokens per rank per step")
    parser.add_argument("--hidden", type=int, default=DemoSpec.hidden_size)
    parser.add_argument("--experts", type=int, default=DemoSpec.num_experts)
    parser.add_argument("--topk", type=int, default=DemoSpec.topk)
    parser.add_argument("--lr", type=float, default=DemoSpec.lr)
    args = parser.parse_args(argv)
    spec = DemoSpec(steps=args.steps, tokens_per_rank=args.tokens, hidden_size=args.hidden,
                    num_experts=args.experts, topk=args.topk, lr=args.lr, backend=args.backend)
    ep_plugin.get_backend(spec.backend)  # unknown names fail here, before any process starts
    if args.ranks < 1 or args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be divisible by --ranks {args.ranks} (>= 1)")
    losses = run_ranks(train, args.ranks, spec, device=args.device, timeout_s=max(600.0, 10.0 * args.steps))[0]
    print(f"loss: first {losses[0]:.5f} -> last {losses[-1]:.5f} over {len(losses)} steps "
          f"({'decreased' if losses[-1] < losses[0] else 'DID NOT DECREASE'})")
    return 0 if losses[-1] < losses[0] else 1
