"""Run as a script: two processes from torch.multiprocessing.spawn (which sets no RANK), each
attaching the agent before or after init_process_group, training a few DDP steps and recording
to a file; each process writes what its agent counted, to show training went on either way."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import trainvitals.agent as tv


def work(rank: int, world: int, when: str, out_dir: str, port: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tv.AgentConfig(collector="", record_file=f"{out_dir}/rec-{{rank}}.jsonl", spill_dir=f"{out_dir}/spool")
    if when == "before":
        agent = tv.attach(model, opt, run="spawned", config=config)
        time.sleep(2.5)  # a slow rendezvous: longer than the agent's 2 s send interval
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if when == "after":
        agent = tv.attach(model, opt, run="spawned", config=config)
    ddp = nn.parallel.DistributedDataParallel(model)
    for _ in range(4):
        loss = ddp(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.step(loss=loss)
    stats = agent.stats()
    agent.close()
    with open(f"{out_dir}/trained-{rank}.json", "w") as fh:
        json.dump(stats, fh)
    # DDP's reducer goes before the process group: freed after it (on return), gloo's worker thread
    # and this one could deadlock over the GIL at exit, with the agent attached or not.
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    when, out_dir, port = sys.argv[1:4]
    mp.spawn(work, args=(2, when, out_dir, port), nprocs=2)
