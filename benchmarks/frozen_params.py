"""What watching frozen parameters costs the gradient-norm measurement on the training thread.

    python benchmarks/frozen_params.py [--frozen 300] [--trainable 40]     # ~10 seconds, one core

Since 2026-11-29 the agent watches every parameter of the model, frozen ones too, so that layers
unfrozen during training count in the gradient norms from their first gradient (agent/_grad_norms.py).
Each step, `GradNormTracker.compute()` then also reads `.grad` of every frozen parameter (None,
skipped). This times `compute()` on a LoRA-like model, `--frozen` frozen parameters (Linear weights
and biases) and `--trainable` trainable adapter weights, twice in the same run: watching every
parameter (today) and watching only the trainable ones (what attach() watched before). Times are
the best of 5 repeats of 2,000 calls (the machine is shared: the least disturbed repeat).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from trainvitals.agent._grad_norms import GradNormTracker


def _per_call_us(tracker: GradNormTracker, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(200):
        tracker.compute()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            tracker.compute()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frozen", type=int, default=300, help="frozen parameters (an even number)")
    parser.add_argument("--trainable", type=int, default=40, help="trainable adapter weights")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(64, 64) for _ in range(args.frozen // 2)])
    adapters = nn.ModuleList(nn.Linear(64, 4, bias=False) for _ in range(args.trainable))
    base.requires_grad_(False)
    x = torch.randn(8, 64)
    (adapters[0](base(x)).sum() + sum(a(x).sum() for a in adapters)).backward()

    every = _per_call_us(GradNormTracker(nn.ModuleDict({"base": base, "adapters": adapters})))
    trainable = _per_call_us(GradNormTracker(nn.ModuleDict({"adapters": adapters})))
    frozen = 2 * (args.frozen // 2)
    print(f"compute(), every parameter watched ({frozen + args.trainable}):  {every:7.1f} us")
    print(f"compute(), the trainable ones only ({args.trainable}):       {trainable:7.1f} us")
    print(f"ratio {every / trainable:.2f}; {(every - trainable) / frozen * 1e3:.0f} ns per frozen parameter a step")


if __name__ == "__main__":
    main()
