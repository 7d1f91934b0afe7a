"""The main job: a small MoE model trained across N ranks through ep_plugin's dispatch/combine.

Each rank holds a replica of the router and E/N experts (two-layer MLPs). Tokens are
synthetic: every step each rank draws fresh inputs and learns to imitate a fixed random
teacher network. The router's gradients are summed over ranks (data parallel); expert
gradients arrive through combine's backward from every rank's tokens. The verdict compares
the loss on one held-out batch before and after training.

Default: 4 CPU ranks over gloo with the reference backend; with a GPU, the hybrid CUDA
backend when it is built (else reference), ranks sharing the GPU under MPS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ep_plugin
from ep_plugin.cli import (
    OneLineParser,
    backend_problem,
    config_problem,
    default_device,
    device_problem,
    gpu_count,
    host_memory,
)
from ep_plugin.config import Config
from ep_plugin.testing import RankContext, plan_launch, run_ranks
from ep_plugin.testing.launcher import CPU_RANKS_PER_CORE, cpu_ranks_problem, mps_problem


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

    def route(self, x: torch.Tensor) -> dict:
        """Each token's top-k experts, weights renormalised, in the routing form the backend takes:
        routing_map [T, E] bool with probs [T, E] float32, or topk_idx [T, k] with topk_weights [T, k]."""
        scores = torch.softmax(self.router(x), dim=-1)
        top_scores, top_experts = scores.topk(self.spec.topk, dim=-1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        if "routing_map" not in self.backend.capabilities.routing_forms:  # elastic
            return dict(topk_idx=top_experts, topk_weights=top_scores)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_experts, True)
        probs = torch.zeros_like(scores).scatter(1, top_experts, top_scores)
        return dict(routing_map=routing_map, probs=probs)

    def expert(self, local_expert: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's expert ``local_expert`` (a two-layer MLP) on rows [N, H] float32."""
        return F.gelu(rows @ self.w_in[local_expert]) @ self.w_out[local_expert]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows grouped by local expert, one prob each: a backend that also has a compact form is asked for these.
        expand = dict(expand=True, zero_padding=True) if "expand" in self.backend.capabilities.dispatch_options else {}
        out = ep_plugin.dispatch(self.backend, x.to(self.payload_dtype).contiguous(), **self.route(x), **expand)
        counts = out.tokens_per_expert.tolist()
        # Non-blocking mode (EP_PLUGIN_BLOCKING=0) sizes the output to a budget: the rows past the counts'
        # sum hold nothing and stay out of the experts (their combine input is zero).
        valid, budget = sum(counts), out.hidden.shape[0]
        if valid > budget:
            raise RuntimeError(f"ep_plugin demo: {valid} rows arrived for a non-blocking budget of {budget} "
                               f"(rows were dropped): raise EP_PLUGIN_NUM_PERMUTED_TOKENS or set it to 0")
        segments = torch.split(out.hidden[:valid].float(), counts)
        expert_rows = [self.expert(e, seg) for e, seg in enumerate(segments)]
        rows = torch.cat(expert_rows) * out.probs[:valid].unsqueeze(1)
        if valid < budget:
            rows = torch.cat([rows, rows.new_zeros(budget - valid, rows.shape[1])])
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


def held_out_tokens(spec: DemoSpec, rank: int, world_size: int) -> torch.Tensor:
    """The held-out inputs ``rank`` draws, as a step's are: at step -1, a seed no training step draws with."""
    return synthetic_tokens(spec, -1, rank, world_size)


@dataclass(frozen=True)
class DemoResult:
    """What ``train`` returns: every step's global mean loss, and the global mean loss on the held-out batch
    before the first step and after the last (the verdict's: one batch, so batch-to-batch noise stays out)."""

    losses: list[float]
    held_out_before: float
    held_out_after: float


def _rank_loss(model: MoELayer, x: torch.Tensor, spec: DemoSpec, world_size: int) -> torch.Tensor:
    """This rank's share of the global mean loss on ``x`` (the ranks' shares sum to it)."""
    return F.mse_loss(model(x), teacher(x, spec.seed)) / world_size


def _held_out_loss(model: MoELayer, x: torch.Tensor, spec: DemoSpec, world_size: int) -> float:
    """The global mean loss on ``x``, with no gradient step. Every rank calls it at the same point: the forward
    dispatches and combines, and the loss is summed over ranks."""
    with torch.no_grad():
        loss = _rank_loss(model, x, spec, world_size)
    dist.all_reduce(loss)
    return float(loss)


def train(ctx: RankContext, spec: DemoSpec) -> DemoResult:
    """Train for spec.steps on this rank; returns every step's global mean loss and the held-out ones."""
    torch.set_num_threads(1)
    device = torch.device(ctx.device)
    backend = ep_plugin.get_backend(spec.backend)(hidden_size=spec.hidden_size, num_experts=spec.num_experts,
                                                  device=device)
    # fp32 tokens where the backend moves them (reference), else bf16 (the compiled backends).
    payload_dtype = torch.float32 if torch.float32 in backend.capabilities.hidden_dtypes else torch.bfloat16
    model = MoELayer(spec, backend, payload_dtype, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.lr)
    held_out = held_out_tokens(spec, ctx.rank, ctx.world_size).to(device)
    held_out_before = _held_out_loss(model, held_out, spec, ctx.world_size)
    progress = _progress(ctx, spec)
    losses, step_rates = [], []
    for step in range(spec.steps):
        step_start = time.perf_counter()
        x = synthetic_tokens(spec, step, ctx.rank, ctx.world_size).to(device)
        loss = _rank_loss(model, x, spec, ctx.world_size)
        optimizer.zero_grad()
        loss.backward()
        dist.all_reduce(model.router.weight.grad)
        dist.all_reduce(model.router.bias.grad)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss))  # a host read: the step is complete
        # This step's rate (all ranks' tokens), not a running average that keeps the warm-up in.
        step_rates.append(spec.tokens_per_rank * ctx.world_size / (time.perf_counter() - step_start))
        if ctx.rank == 0:
            _log_step(progress, f"step {step + 1:3d}  loss {losses[-1]:.5f}  tokens/s {step_rates[-1]:,.0f}",
                      losses[-1], step_rates[-1])
    if progress is not None:
        progress.close()
    held_out_after = _held_out_loss(model, held_out, spec, ctx.world_size)
    if ctx.rank == 0 and step_rates:
        after_warmup = step_rates[1:] or step_rates
        which = f"steps 2-{spec.steps}" if spec.steps > 1 else "step 1 (includes the warm-up)"
        _say(f"tokens/s: median {statistics.median(after_warmup):,.0f} over {which}")
    backend.destroy()
    return DemoResult(losses, held_out_before, held_out_after)


def _progress(ctx: RankContext, spec: DemoSpec):
    """A progress bar on rank 0 when stderr is a terminal; None elsewhere (plain step lines)."""
    if ctx.rank != 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=spec.steps, desc=f"MoE demo ({spec.backend}, {ctx.world_size} ranks, {ctx.device})",
                unit="step")


def _say(line: str) -> None:
    """Rank 0's line on stdout; a reader that left (``demo | head``) ends the printing, not the training."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _log_step(progress, line: str, loss: float, tokens_per_s: float) -> None:
    """One step line on stdout: through the bar on a terminal, else a plain line."""
    if progress is None:
        _say(line)
        return
    progress.set_postfix(loss=f"{loss:.4f}", tokens_per_s=f"{tokens_per_s:,.0f}")
    progress.update()
    progress.write(line)


DEFAULT_RANKS = 4


def default_device_and_backend() -> tuple[str, str]:
    device = default_device()
    if device == "cuda" and backend_problem("hybrid", "cuda") is None:
        return device, "hybrid"
    return device, "reference"


def default_launch(device: str, ranks: int, num_gpus: int) -> tuple[str, Optional[str]]:
    """(device, a note or None) for a launch left to the defaults: more ranks than GPUs share them under
    MPS, and where its tools are missing (a container, WSL) the default runs on the CPU instead of
    refusing (an explicit --device cuda / --ranks still gets the refusal, which says what to change)."""
    problem = mps_problem(ranks, num_gpus) if device == "cuda" else None
    if problem is None:
        return device, None
    return "cpu", (f"ep_plugin demo: {problem}. Running on the CPU instead; --device cuda --ranks {num_gpus} "
                   f"runs one rank per GPU")


def _argument_problem(args: argparse.Namespace) -> Optional[str]:
    """The first thing wrong with the options, in one line, or None."""
    problem = device_problem(args.device) or backend_problem(args.backend, args.device) or config_problem()
    if problem:
        return problem
    for flag, value in (("--ranks", args.ranks), ("--steps", args.steps), ("--tokens", args.tokens),
                        ("--hidden", args.hidden), ("--experts", args.experts), ("--topk", args.topk)):
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    problem = cpu_ranks_problem(args.ranks, args.device) or (
        mps_problem(args.ranks, gpu_count()) if args.device == "cuda" else None)
    if problem:
        return f"--ranks {args.ranks}: {problem}"
    config = Config.from_env()  # the backend is built with the environment's config
    if args.tokens > config.max_tokens_per_rank:
        return (f"--tokens {args.tokens} is over max_tokens_per_rank={config.max_tokens_per_rank} "
                f"(raise EP_PLUGIN_MAX_TOKENS_PER_RANK)")
    if config.scaleup_size and args.ranks % config.scaleup_size:
        return (f"EP_PLUGIN_SCALEUP_SIZE={config.scaleup_size} does not divide --ranks {args.ranks} into NVLink "
                f"domains (unset it, or pick a divisor)")
    if args.topk > args.experts:
        return f"--topk {args.topk} is more than the {args.experts} experts (--experts)"
    if args.experts % args.ranks:
        return f"--experts {args.experts} must be divisible by --ranks {args.ranks}"
    problem = backend_limits_problem(args) or _memory_problem(args)
    if problem:
        return problem
    if not 0 < args.lr <= torch.finfo(torch.float32).max:  # Adam takes it as a float32 step (1e39 overflowed)
        return f"--lr must be a positive number a float32 holds, got {args.lr}"
    return None


def backend_limits_problem(args: argparse.Namespace) -> Optional[str]:
    """The backend's kernel limits (hidden size, local experts, top-k) the options pass, in one line, or None:
    checked here, not in every rank once it started."""
    backend_class = ep_plugin.get_backend(args.backend)
    problem = backend_class.shape_problem(args.hidden, args.experts // args.ranks)
    if problem:
        return f"--backend {args.backend}: {problem}"
    problem = backend_class.topk_problem(args.topk)
    return f"--topk {args.topk}: {problem}" if problem else None


def host_bytes_per_rank(spec: DemoSpec, num_ranks: int) -> int:
    """About what one rank's training allocates (float32): the teacher's two [H, H] weights, the router and this
    rank's experts with their gradients and Adam's two moments, a step's [T, H] and [T, E] activations (a few of
    each), and the rows it receives and their expert activations (twice a balanced share, T x top-k rows: the
    router starts near uniform). On a GPU most of it is there rather than in host memory; the teacher is drawn
    on the host either way. (8 ranks x 2048 tokens, hidden 1024, 64 experts, top-8 on CPU: 4.8 GiB estimated
    for the ranks' tensors; 6.2 GiB was the machine's peak, torch's own ~0.3 GiB a process included.)"""
    hidden, experts, tokens = spec.hidden_size, spec.num_experts, spec.tokens_per_rank
    parameters = hidden * experts + experts + 2 * (experts // num_ranks) * hidden * spec.ffn_size
    activations = 8 * tokens * hidden + 4 * tokens * experts
    received = 4 * 2 * tokens * spec.topk * max(hidden, spec.ffn_size)
    return 4 * (2 * hidden * hidden + 4 * parameters + activations + received)


def _memory_problem(args: argparse.Namespace) -> Optional[str]:
    """Whether the ranks' training would need more than half the host memory this process can still have (a size
    typed wrong: it would fail in every rank, one traceback each), or None. CPU ranks share the host's memory; the
    figure is the bench's: MemAvailable, or a container's limit below it."""
    memory = host_memory()
    if memory is None:  # not known here: no check
        return None
    spec = DemoSpec(tokens_per_rank=args.tokens, hidden_size=args.hidden, num_experts=args.experts, topk=args.topk)
    need = host_bytes_per_rank(spec, args.ranks) * (args.ranks if args.device == "cpu" else 1)
    # Half: the estimate reads about a quarter under the peak (above), and the ranks are not all there is.
    if need <= memory.bytes // 2:
        return None
    return (f"--hidden {args.hidden}, --experts {args.experts}, --tokens {args.tokens} on {args.ranks} rank(s) need "
            f"about {need / 2**30:,.1f} GiB, more than half of {memory.limit} ({memory.bytes / 2**30:,.1f} GiB)")


def _describe_launch(args: argparse.Namespace) -> str:
    plan = plan_launch(args.ranks, args.device, gpu_count() if args.device == "cuda" else 0)
    if plan.device_type == "cpu":
        placement = "CPU processes over gloo"
    elif plan.use_mps:
        placement = f"sharing {len(set(plan.gpu_of_rank))} GPU(s) over gloo under a private MPS daemon"
    else:
        placement = "one GPU each over NCCL"
    return (f"ep_plugin demo: backend {args.backend}, device {args.device}, {args.ranks} ranks ({placement}); "
            f"{args.steps} steps of {args.tokens} tokens per rank, hidden {args.hidden}, {args.experts} experts, "
            f"top-{args.topk}")


def main(argv: list[str] | None = None) -> int:
    device, default_backend = default_device_and_backend()
    parser = OneLineParser(prog="python -m ep_plugin demo", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None,
                        help=f"number of rank processes (default {DEFAULT_RANKS}; on CPU at most {CPU_RANKS_PER_CORE} "
                             "per core)")
    parser.add_argument("--steps", type=int, default=DemoSpec.steps, help=f"training steps (default {DemoSpec.steps})")
    parser.add_argument("--backend", default=None,
                        help=f"one of {', '.join(ep_plugin.list_backends())} (default: hybrid on a GPU that runs it, "
                             f"else reference; here: {default_backend})")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help=f"default here: {device}")
    parser.add_argument("--tokens", type=int, default=DemoSpec.tokens_per_rank,
                        help=f"tokens per rank per step (default {DemoSpec.tokens_per_rank})")
    parser.add_argument("--hidden", type=int, default=DemoSpec.hidden_size,
                        help=f"hidden size (default {DemoSpec.hidden_size})")
    parser.add_argument("--experts", type=int, default=DemoSpec.num_experts,
                        help=f"experts in all, divisible by --ranks (default {DemoSpec.num_experts})")
    parser.add_argument("--topk", type=int, default=DemoSpec.topk,
                        help=f"experts per token, at most --experts (default {DemoSpec.topk})")
    parser.add_argument("--lr", type=float, default=DemoSpec.lr, help=f"Adam learning rate (default {DemoSpec.lr})")
    args = parser.parse_args(argv)
    if args.ranks is None and args.device is None:
        args.device, note = default_launch(device, DEFAULT_RANKS, gpu_count())
        if note:
            print(note, flush=True)
    args.ranks = DEFAULT_RANKS if args.ranks is None else args.ranks
    args.device = device if args.device is None else args.device
    if args.backend is None:  # after --device: --device cpu on a GPU machine means reference
        args.backend = default_backend if args.device == device else "reference"
    problem = _argument_problem(args)
    if problem:
        parser.error(problem)  # one line, exit status 2, before any process starts
    spec = DemoSpec(steps=args.steps, tokens_per_rank=args.tokens, hidden_size=args.hidden,
                    num_experts=args.experts, topk=args.topk, lr=args.lr, backend=args.backend)
    print(_describe_launch(args), flush=True)
    # Past ep_plugin's own timeout (EP_PLUGIN_TIMEOUT_S), so that a rank's report naming the late peer comes first.
    launcher_timeout_s = max(600.0, 10.0 * args.steps, Config.from_env().timeout_s + 60.0)
    result = run_ranks(train, args.ranks, spec, device=args.device, timeout_s=launcher_timeout_s)[0]
    before, after = result.held_out_before, result.held_out_after
    decreased = after < before
    print(f"held-out loss: before {before:.5f} -> after {after:.5f} over {args.steps} step{'s' * (args.steps > 1)} "
          f"({'decreased' if decreased else 'DID NOT DECREASE'})")
    return 0 if decreased else 1
