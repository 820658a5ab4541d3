"""A DDP job (gloo, one process) that registers its own comm hook after attach(), as jobs using
PowerSGD or bf16 compression do: python comm_hook_job.py OUT_DIR PORT. Writes OUT_DIR/result.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import trainvitals.agent as tv

out, port = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = DistributedDataParallel(nn.Linear(8, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
agent = tv.attach(model, optimizer, run="hook", config=tv.AgentConfig(collector="", record_file=str(out / "rec.jsonl"),
                                                                      spill_dir=str(out / "spool")))
calls: list[object] = []


def job_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP checks the signature
    calls.append(state)
    return allreduce_hook(None, bucket)


model.register_comm_hook("job-state", job_hook)  # raised "can only be called once" before
try:
    model.register_comm_hook("again", job_hook)
    second = "accepted"
except RuntimeError as exc:
    second = str(exc)
for _ in range(4):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    agent.step(loss=loss)
agent.close()
dist.destroy_process_group()
(out / "result.json").write_text(json.dumps({"calls": calls, "second": second}))
