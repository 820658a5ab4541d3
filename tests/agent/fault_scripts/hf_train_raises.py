"""A transformers Trainer run whose train() raises at step 5, uncaught: the process ends on it.

Run by tests/agent/test_integration_hf.py: argv = the agent's record file (with `{rank}`), the
spill directory, the output directory. A callback after TrainvitalsCallback raises in on_step_end
of step 5, between the step's end and its log: HF calls no callback when train() raises, so the
step record TrainvitalsCallback holds for that log, and the failure, reach the collector only
through the interpreter's exit.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from trainvitals.agent import AgentConfig
from trainvitals.agent.integrations.hf import TrainvitalsCallback


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _BoomAtStep5(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 5:
            raise RuntimeError("boom at step 5")


def main() -> None:
    record, spill, out = sys.argv[1:4]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)  # fmt: skip
    config = AgentConfig(collector="", record_file=record, spill_dir=spill)
    callback = TrainvitalsCallback(run="hf-raises", config=config)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback, _BoomAtStep5()])
    trainer.train()


if __name__ == "__main__":
    main()
