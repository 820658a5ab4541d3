"""Run under torchrun: a tiny model under DDP, FSDP2 (fully_shard) or FSDP1 (FullyShardedDataParallel)
on CPU/gloo with the agent recording to a file; every rank also writes the job's own total gradient
norm per step (clip_grad_norm_'s, FSDP1's own method under FSDP1) for comparison."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import trainvitals.agent as tv


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16)) for _ in range(3)
        )
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def main() -> None:
    # mode: ddp, fsdp2, fsdp1 (flat parameters), fsdp1-orig (use_orig_params=True), ddp-attach-first
    # (attach() to the bare model before init_process_group, as a script may: the gradient ownership
    # must be decided against the process group anyway) or fsdp2-attach-first (attach() to the bare
    # model, then fully_shard, which swaps every parameter for a sharded one; the optimizer comes
    # after, as FSDP2 needs, so the agent measures through grads_ready()).
    mode, out_dir = sys.argv[1], sys.argv[2]
    config = tv.AgentConfig(
        fp8=sys.argv[3] if len(sys.argv) > 3 else "auto",
        collector="",
        record_file=f"{out_dir}/rec-{{rank}}.jsonl",
        spill_dir=f"{out_dir}/spool",
    )
    torch.manual_seed(0)
    model = Tiny()
    if mode == "ddp-attach-first":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        agent = tv.attach(model, opt, run=f"gn-{mode}", config=config)
        dist.init_process_group("gloo")
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp2-attach-first":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        agent = tv.attach(model, run=f"gn-{mode}", config=config)
        for layer in model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    else:
        dist.init_process_group("gloo")
        if mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        elif mode.startswith("fsdp1"):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                           use_orig_params=mode == "fsdp1-orig", device_id=torch.device("cpu"))  # fmt: skip
        else:
            wrapped = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        agent = tv.attach(wrapped, opt, run=f"gn-{mode}", config=config)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    totals = []
    for step in range(5):
        x = torch.randint(0, 32, (4, 6), generator=gen)
        loss = wrapped(x).logsumexp(-1).mean() * (1 + step)
        loss.backward()
        if mode == "fsdp2-attach-first":
            agent.grads_ready()  # no optimizer attached: measured here
        if mode.startswith("fsdp1"):  # torch's function would see this rank's shard only
            total = wrapped.clip_grad_norm_(float("inf"))
        else:
            total = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), float("inf"))
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        totals.append(total.item())
        opt.step()
        opt.zero_grad()
        agent.step(loss=loss, step=step)
    agent.close()
    with open(f"{out_dir}/totals-{rank}.json", "w") as fh:
        json.dump(totals, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
