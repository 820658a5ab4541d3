"""A small GPT trained on synthetic tokens with DDP, with the trainvitals agent attached.

    torchrun --nproc_per_node=4 -m trainvitals.examples.train_gpt --steps 200

Fault-injection flags (for the detectors and the demo):
  --slow-rank R --slow-from S --slow-seconds X    rank R sleeps X s per step from step S
  --drift-layer L --drift-from S --drift-rate K   activations into block L grow by (1 + K)^(step - S)
  --spike-steps 50,51 --spike-scale 30            loss (so every gradient) scaled at those steps
  --crash-rank R --crash-at S                     rank R exits with an error at step S unless the job
                                                  resumed from --ckpt-dir (relaunch it to see the restart)

--plan FILE merges a JSON object into the run registration: the plan of the job this example stands
in for, e.g. {"parallelism": {"pp": 2}, "hardware": {"gpu_type": "H100-SXM"}, "tags": {"mtbf_s": "3600"}}.
The example still trains plain DDP; what the collector sees (pipeline stages, the MFU its cost
model predicts, the MTBF the checkpoint advisor uses) follows the declaration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainvitals.agent as tv


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.drift = 1.0  # fault injection: scales the MLP input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x) * self.drift)))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def model_dims(args: argparse.Namespace, model: GPT) -> dict[str, int]:
    params = sum(p.numel() for p in model.parameters())
    embedding = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    return {
        "layers": args.layers,
        "hidden": args.d,
        "heads": args.heads,
        "ffn_hidden": 4 * args.d,
        "vocab": args.vocab,
        "seq_len": args.seq,
        "params": params,
        "non_embedding_params": params - embedding,
    }


def flops_per_token(dims: dict[str, int]) -> float:
    """PaLM appendix B: 6N + 12 L H Q T (N non-embedding params, H*Q = d, T sequence length)."""
    return 6 * dims["non_embedding_params"] + 12 * dims["layers"] * dims["hidden"] * dims["seq_len"]


def synthetic_batch(gen: torch.Generator, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    # A learnable pattern (next token = token + 1 mod vocab, with noise) so the loss really falls.
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    seq = (start + torch.arange(args.seq + 1)) % args.vocab
    noise = torch.randint(0, args.vocab, seq.shape, generator=gen)
    seq = torch.where(torch.rand(seq.shape, generator=gen) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def save_generation(
    agent: tv.TrainingAgent,
    ckpt_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    keep: int = 3,
) -> None:
    """One generation per save (recorded by the agent: stall, size, checksum), a `latest` pointer
    written after the file is complete, and the oldest generations pruned beyond `keep`."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:08d}.pt"
    agent.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, str(path), step=step)
    tmp = ckpt_dir / "latest.tmp"
    tmp.write_text(path.name)
    os.replace(tmp, ckpt_dir / "latest")
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-keep]:
        old.unlink()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-name", default=os.environ.get("TRAINVITALS_RUN", "example-gpt"))
    p.add_argument("--collector", default=None, help="default $TRAINVITALS_COLLECTOR or http://127.0.0.1:8000")
    p.add_argument("--project", default=None, help="the run's project (the tokens'); default: the agent's")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long (all ranks agree)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fp8",
        action="store_true",
        help="train through emulated FP8 delayed scaling (real float8 casts on CPU)",
    )
    p.add_argument("--fp8-history", type=int, default=16, help="amax history length L")
    p.add_argument(
        "--fp8-expensive-every",
        type=int,
        default=None,
        help="FP8 expensive tier (saturation, underflow, crest) every this many steps; default: the agent's (200)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm; 0: no clipping")
    p.add_argument("--ckpt-dir", default=None, help="save here every --ckpt-every steps; resume from it")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument(
        "--peak-flops",
        type=float,
        default=5e10,
        help="declared peak FLOP/s per rank (for MFU; a CPU core does a few 10^10)",
    )
    p.add_argument("--send-interval", type=float, default=1.0)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-seconds", type=float, default=0.05)
    p.add_argument("--drift-layer", type=int, default=None)
    p.add_argument("--drift-from", type=int, default=0)
    p.add_argument("--drift-rate", type=float, default=0.01)
    p.add_argument("--spike-steps", default="", help="comma-separated steps whose loss is scaled")
    p.add_argument("--spike-scale", type=float, default=30.0)
    p.add_argument("--crash-rank", type=int, default=None, help="rank that crashes (with --crash-at)")
    p.add_argument("--crash-at", type=int, default=None, help="step it crashes at (with --crash-rank)")
    p.add_argument("--plan", type=Path, default=None, help="JSON merged into the run registration (see above)")
    args = p.parse_args(argv)
    # One of the two alone crashed nothing, in silence.
    if (args.crash_rank is None) != (args.crash_at is None):
        p.error("--crash-rank and --crash-at go together: --crash-rank R --crash-at S crashes rank R at step S")
    if args.send_interval <= 0:
        p.error(f"--send-interval must be > 0 seconds, not {args.send_interval:g}")  # AgentConfig would raise
    return args


def merged(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overlay` merged in, nested objects key by key."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks share a few CPU cores
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, seq=args.seq)
    dims = model_dims(args, model)
    if args.fp8:
        from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

        # Every block Linear trains through FP8; the output head stays in high precision, as usual.
        convert_linears(model.layers, DelayedScalingRecipe(history_len=args.fp8_history))
    ddp: nn.Module = DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    start_step = 0
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else None
    latest = ckpt_dir / "latest" if ckpt_dir else None
    resumed_from = None
    if latest is not None and latest.exists():
        resumed_from = ckpt_dir / latest.read_text().strip()  # type: ignore[operator]
        state = torch.load(resumed_from, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = int(state["step"]) + 1

    tokens_per_step = args.batch * args.seq
    registration: dict[str, Any] = {
        "model": dims,
        "parallelism": {
            "world_size": world,
            "dp": world,
            "micro_batch": args.batch,
            "global_batch": args.batch * world,
        },
        "hardware": {"gpu_type": "cpu", "gpu_count": world, "peak_flops": args.peak_flops},
        "fp8": {"enabled": args.fp8, "history_len": args.fp8_history if args.fp8 else 1024},
        "flops_convention": "6N+12LHQT per token (PaLM), no recompute",
    }
    if args.plan is not None:
        registration = merged(registration, json.loads(args.plan.read_text()))
    agent = tv.attach(
        ddp,
        optimizer,
        run=args.run_name,
        collector=args.collector,
        **({"project": args.project} if args.project else {}),
        config=tv.AgentConfig(
            collector=args.collector,
            send_interval_s=args.send_interval,
            **({} if args.fp8_expensive_every is None else {"fp8_expensive_every_steps": args.fp8_expensive_every}),
        ),
        registration=registration,
    )
    if resumed_from is not None:
        agent.loaded(step=start_step - 1, path=str(resumed_from))

    spikes = {int(s) for s in args.spike_steps.split(",") if s}
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    deadline = time.time() + args.max_seconds if args.max_seconds else math.inf
    stop = torch.zeros(1)
    step = start_step
    while step < args.steps:
        if args.drift_layer is not None and step >= args.drift_from:
            model.layers[args.drift_layer].drift = (1 + args.drift_rate) ** (step - args.drift_from)
        x, y = synthetic_batch(gen, args)
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        (loss * (args.spike_scale if step in spikes else 1.0)).backward()
        # Clipping as most LLM recipes do (--clip 0: measure the total norm only), through the agent:
        # torch's clip_grad_norm_, whose per-parameter norms also give the agent this step's pre-clip
        # group norms, so the gradients are read once rather than twice.
        total_norm = agent.clip_grad_norm_(ddp.parameters(), args.clip if args.clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == args.slow_rank and step >= args.slow_from:
            time.sleep(args.slow_seconds)
        if (
            rank == args.crash_rank
            and step == args.crash_at
            and resumed_from is None  # the relaunched job gets past the step
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
        ):
            agent.event("failure", detail="injected crash", domains={"host": os.uname().nodename})
            agent.close()
            print(f"rank {rank}: injected crash at step {step}", file=sys.stderr)
            os._exit(17)
        agent.step(
            loss=loss,
            grad_norm=total_norm,
            tokens=tokens_per_step,
            flops=tokens_per_step * flops_per_token(dims),
            step=step,
        )
        if ckpt_dir is not None and step % args.ckpt_every == 0 and step > 0:
            if rank == 0:
                save_generation(agent, ckpt_dir, step, model, optimizer)
            if distributed:
                dist.barrier()
        step += 1
        if deadline < math.inf and step % 10 == 0:
            # Every rank must stop at the same step or the others hang in the next all-reduce.
            stop.fill_(1.0 if time.time() > deadline else 0.0)
            if distributed:
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
    agent.close()
    if rank == 0:
        print(f"trained {step - start_step} steps on {world} ranks; final loss {loss.item():.3f}")
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
