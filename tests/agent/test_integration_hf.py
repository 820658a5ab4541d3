"""transformers Trainer callback: real short CPU training runs of a tiny random GPT-2, no downloads.

Every assertion compares what the agent recorded with what the Trainer itself logged or holds.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from trainvitals.agent import AgentConfig
from trainvitals.agent.integrations import hf
from trainvitals.agent.integrations.hf import TrainvitalsCallback
from trainvitals.wire import Batch, RunRegistration

SEQ = 16
BATCH = 4


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences; labels = inputs (causal LM)."""

    def __init__(self, n: int = 128) -> None:
        self.ids = torch.randint(0, 64, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _run(
    tmp: Path,
    *,
    name: str,
    max_steps: int = 12,
    logging_steps: int = 1,
    save_steps: int = 6,
    resume_from: str | None = None,
    bind_trainer: bool = False,
    collector: str = "",
    save_total_limit: int | None = None,
    max_grad_norm: float = 1.0,
    preempt_at: int | None = None,
) -> tuple[Trainer, TrainvitalsCallback, list[Any], RunRegistration]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(
        output_dir=str(tmp / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        logging_steps=logging_steps,
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
        lr_scheduler_type="linear",
        learning_rate=1e-3,
        max_grad_norm=max_grad_norm,
        enable_jit_checkpoint=preempt_at is not None,
    )
    record = tmp / f"{name}-{{rank}}.jsonl"
    config = AgentConfig(collector=collector, record_file=str(record), spill_dir=str(tmp / "spool"))
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    callback = TrainvitalsCallback(run=f"hf-{name}", config=config, trainer=trainer if bind_trainer else None)
    trainer.add_callback(callback)
    if preempt_at is not None:
        trainer.add_callback(_PreemptedAt(trainer, preempt_at))
    trainer.train(resume_from_checkpoint=resume_from)
    lines = (tmp / f"{name}-0.jsonl").read_bytes().splitlines()
    registration = RunRegistration.model_validate_json(lines[0])
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    return trainer, callback, records, registration


class _PreemptedAt(TrainerCallback):
    """What enable_jit_checkpoint's SIGTERM handler does `kill_wait` (3 s) after the signal: set the
    flag on which HF's JIT callback saves and stops. Set at the start of the step after `step`."""

    def __init__(self, trainer: Trainer, step: int) -> None:
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step == self.step:
            handler = self.trainer.callback_handler
            jit = next(c for c in handler.callbacks if type(c).__name__ == "JITCheckpointCallback")
            jit.jit_manager.is_checkpoint_requested = True


def _train_logs(trainer: Trainer) -> dict[int, dict[str, float]]:
    return {int(e["step"]): e for e in trainer.state.log_history if "loss" in e}


def test_one_step_record_per_optimizer_step_matching_the_trainer_logs(tmp_path: Path) -> None:
    trainer, callback, records, registration = _run(tmp_path, name="basic")
    logs = _train_logs(trainer)
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(1, 13))  # HF's own numbering: global_step
    for s in steps:
        assert s.loss is not None and math.isfinite(s.loss)
        assert s.loss == pytest.approx(logs[s.step]["loss"], rel=1e-6)
        assert s.lr == pytest.approx(logs[s.step]["learning_rate"], rel=1e-9)  # the lr the step used
        assert s.grad_norm == pytest.approx(logs[s.step]["grad_norm"], rel=1e-6)
        assert s.tokens == BATCH * SEQ
    assert len({s.lr for s in steps}) > 1  # the linear schedule really moved

    # The agent's own gradient norms are pre-clip too: measured before HF clips to max_grad_norm.
    grads = {r.step: r for r in records if r.kind == "grad" and r.group == "__global__"}
    assert sorted(grads) == list(range(1, 13))
    for s in steps:
        assert math.sqrt(grads[s.step].owned_sq) == pytest.approx(logs[s.step]["grad_norm"], rel=1e-4)
    assert any(r.kind == "grad" and r.group == "transformer.h.1" for r in records)

    events = [r for r in records if r.kind == "event"]
    assert [e.event for e in events][0] == "start" and events[-1].event == "stop"
    # Saves become checkpoint generations (agent.checkpoint_saved): size and checksum hashed off-thread.
    saves = [r for r in records if r.kind == "checkpoint"]
    assert [(c.step, c.status, Path(c.path).name) for c in saves] == [  # type: ignore[arg-type]
        (6, "persisted", "checkpoint-6"),
        (12, "persisted", "checkpoint-12"),
    ]
    assert all(c.bytes and c.checksum and c.checksum.startswith("sha256:") for c in saves)
    assert not any(e.event == "resume" for e in events)

    # The step record precedes the save of that step in the stream.
    order = [(r.kind, r.step) for r in records if r.kind in ("step", "checkpoint")]
    assert order.index(("step", 6)) < order.index(("checkpoint", 6))

    assert registration.run == "hf-basic"
    assert (
        registration.model.layers == 2 and registration.model.hidden == 32 and registration.model.vocab == 64
    )
    assert registration.parallelism.micro_batch == BATCH
    assert registration.tags["framework"] == "transformers"

    inner = trainer.optimizer.optimizer  # type: ignore[union-attr] # under AcceleratedOptimizer
    assert callback.agent is not None and callback.agent.hooks == 0
    assert len(inner._optimizer_step_pre_hooks) == 0
    assert callback._errors.errors == 0


def _each_step_has_its_own_loss(trainer: Trainer, records: list[Any]) -> dict[int, Any]:
    """The step records of a 12-step run logged every 4 steps: each with a finite loss, and each
    log window's losses averaging to HF's logged mean. Returns them by step."""
    logs = _train_logs(trainer)
    assert sorted(logs) == [4, 8, 12]
    steps = {r.step: r for r in records if r.kind == "step"}
    assert sorted(steps) == list(range(1, 13))
    assert all(s.loss is not None and math.isfinite(s.loss) for s in steps.values())
    for end in (4, 8, 12):
        window = [steps[i].loss for i in range(end - 3, end + 1)]
        assert sum(window) / 4 == pytest.approx(logs[end]["loss"], rel=1e-5)  # type: ignore[arg-type]
    assert len({round(s.loss, 6) for s in steps.values()}) > 1  # type: ignore[arg-type]
    return steps


def test_bound_trainer_gives_every_step_its_own_loss_between_logs(tmp_path: Path) -> None:
    trainer, callback, records, _ = _run(
        tmp_path, name="bound", logging_steps=4, save_steps=100, bind_trainer=True
    )
    _each_step_has_its_own_loss(trainer, records)
    assert callback._errors.errors == 0


def test_every_step_has_the_pre_clip_gradient_norm_not_only_logged_ones(tmp_path: Path) -> None:
    """HF logs grad_norm (pre-clip) every logging_steps; the agent measured at optimizer.step,
    after HF's clip (never above max_grad_norm), and the collector prefers the job's norm where a
    record has one: until 2026-12-04 the series sat at max_grad_norm with a jump at every logged
    step, a false spike each time. Now every step has HF's own pre-clip total, and the group
    norms are measured before the clip. max_grad_norm 0.05: every step of this model is clipped."""
    trainer, callback, records, _ = _run(tmp_path, name="preclip", logging_steps=4, save_steps=100, max_grad_norm=0.05)
    logs = _train_logs(trainer)
    steps = {r.step: r for r in records if r.kind == "step"}
    grads = {r.step: r for r in records if r.kind == "grad" and r.group == "__global__"}
    assert sorted(steps) == sorted(grads) == list(range(1, 13))
    for step, s in steps.items():
        assert s.grad_norm is not None and s.grad_norm > 0.05 * 2  # pre-clip: well above max_grad_norm
        assert math.sqrt(grads[step].owned_sq) == pytest.approx(s.grad_norm, rel=1e-4)
    for step in (4, 8, 12):
        assert steps[step].grad_norm == pytest.approx(logs[step]["grad_norm"], rel=1e-6)
    assert "unscale_gradients" not in vars(trainer.accelerator)  # the accelerator's own methods again
    assert "clip_grad_norm_" not in vars(trainer.accelerator)
    assert callback._errors.errors == 0


def test_a_train_that_raises_records_its_pending_step_and_the_failure_at_exit(tmp_path: Path) -> None:
    """HF calls no callback when train() raises, and the step record the callback holds from
    on_step_end to on_log was lost with it, the failure unsaid: the run looked finished. The child
    raises at step 5 between the two (tests/agent/fault_scripts/hf_train_raises.py)."""
    script = Path(__file__).parent / "fault_scripts" / "hf_train_raises.py"
    record = tmp_path / "raises-{rank}.jsonl"
    child = subprocess.run([sys.executable, str(script), str(record), str(tmp_path / "spool"), str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert child.returncode == 1 and "RuntimeError: boom at step 5" in child.stderr
    lines = (tmp_path / "raises-0.jsonl").read_bytes().splitlines()
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    assert [r.step for r in records if r.kind == "step"] == [1, 2, 3, 4, 5]
    events = [r for r in records if r.kind == "event"]
    assert [e.event for e in events] == ["start", "failure", "stop"]
    assert events[1].detail == "RuntimeError: boom at step 5"
    assert "trainvitals agent error" not in child.stderr


def test_a_callback_made_without_its_trainer_finds_it_and_gives_every_step_its_loss(tmp_path: Path) -> None:
    """The docstring's usage, callbacks=[TrainvitalsCallback(run=...)]: HF passes callbacks no trainer,
    and without it only a one-step log window is a step's loss, so at HF's default logging_steps
    (500) no step record had a loss. The callback finds the Trainer calling it."""
    trainer, callback, records, _ = _run(tmp_path, name="found", logging_steps=4, save_steps=100)
    assert callback._trainer is trainer
    _each_step_has_its_own_loss(trainer, records)
    assert callback._errors.errors == 0


def test_without_a_trainer_window_means_stay_out_of_step_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trainer not found (a loop of one's own calling the callbacks): a 4-step log window is a
    # mean, not any one step's loss, so it is not recorded.
    monkeypatch.setattr(hf, "_calling_trainer", lambda: None)
    _, _, records, _ = _run(tmp_path, name="unbound", max_steps=8, logging_steps=4, save_steps=100)
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(1, 9))
    assert all(s.loss is None for s in steps)
    # Nor is the logged grad_norm: without the Trainer there is no pre-clip norm of every step, and
    # the logged steps' alone, among post-clip ones, would look like spikes.
    assert all(s.grad_norm is None for s in steps)


def test_resume_from_checkpoint_is_an_event_and_step_numbers_continue(tmp_path: Path) -> None:
    _run(tmp_path, name="first", max_steps=6, save_steps=6)
    checkpoint = tmp_path / "out" / "checkpoint-6"
    assert checkpoint.is_dir()
    trainer, _, records, _ = _run(tmp_path, name="resumed", max_steps=12, resume_from=str(checkpoint))
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(7, 13))
    logs = _train_logs(trainer)
    assert [s.loss for s in steps] == pytest.approx([logs[s.step]["loss"] for s in steps], rel=1e-6)
    resumes = [r for r in records if r.kind == "event" and r.event == "resume"]
    assert len(resumes) == 1 and resumes[0].step == 6


def test_attaches_at_the_first_step_when_the_optimizer_is_created_late(tmp_path: Path) -> None:
    # Some setups (delayed optimizer creation) hand callbacks optimizer=None at on_train_begin. No
    # Trainer in this version does that on CPU, so drive the callback as the Trainer's loop does,
    # with real HF state objects and a real model and optimizer.
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    config = AgentConfig(
        collector="", record_file=str(tmp_path / "late-{rank}.jsonl"), spill_dir=str(tmp_path)
    )
    callback = TrainvitalsCallback(run="hf-late", config=config)
    callback.on_train_begin(args, state, control, model=model, optimizer=None)
    assert callback.agent is None
    ids = _Tokens().ids[:BATCH]
    for _ in range(3):
        callback.on_step_begin(args, state, control, model=model, optimizer=opt)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        state.global_step += 1
        callback.on_step_end(args, state, control, model=model, optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == 1
    callback.on_train_end(args, state, control, model=model, optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == 0
    lines = (tmp_path / "late-0.jsonl").read_bytes().splitlines()
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    assert [r.step for r in records if r.kind == "step"] == [1, 2, 3]
    assert [r.step for r in records if r.kind == "grad" and r.group == "__global__"] == [1, 2, 3]
    assert all(r.lr == 0.1 for r in records if r.kind == "step")


def test_steps_reach_a_real_collector(collector: Any, tmp_path: Path) -> None:
    from trainvitals.service.store import queries

    _run(tmp_path, name="live", max_steps=8, save_steps=100, collector=collector.url)
    with collector.app.state.sessionmaker() as session:
        assert queries.count_step_rows(session, run_id="hf-live") == 8
        assert queries.list_runs(session)[0].status == "finished"


def test_checkpoints_save_total_limit_removed_are_no_rollback_target(collector: Any, tmp_path: Path) -> None:
    """HF deletes the oldest checkpoint-N directories past save_total_limit. The rollback query
    named them all the same: asked for a generation before a late divergence, it answered with a
    directory that no longer existed. Now each is recorded as deleted and the answer says so."""
    from trainvitals.service.store import queries

    _run(tmp_path, name="rotated", max_steps=8, save_steps=2, save_total_limit=2, collector=collector.url)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-6", "checkpoint-8"]
    with collector.app.state.sessionmaker() as session:
        gens = queries.checkpoint_generations(session, run_id="hf-rotated")
        before_7 = queries.rollback_target(session, run_id="hf-rotated", before_step=7)
        before_5 = queries.rollback_target(session, run_id="hf-rotated", before_step=5)
        saves, _, _ = queries.observed_cadence_inputs(session, run_id="hf-rotated")
    statuses = [(g["step"], g["status"]) for g in gens]
    assert statuses == [(2, "deleted"), (4, "deleted"), (6, "verified"), (8, "verified")]
    # Each save's stall (until 2026-11-29 none: the cadence advisor had no write time from HF runs),
    # the deleted ones' too: they were written like the others.
    assert all(0 < g["stall_seconds"] < 60 for g in gens) and len(saves) == 4
    assert before_7["target"]["path"] == str(out / "checkpoint-6")
    assert before_5["target"] is None
    assert before_5["reason"] == (
        "before step 5: none, of 4 recorded generation(s) none was persisted and is still on disk before step 5 "
        "(2 deleted since their save (the job's retention, or a later save to the same path), 2 at or after step 5)"
    )


def test_a_restarted_trainer_retires_the_previous_processs_rotated_checkpoints(collector: Any, tmp_path: Path) -> None:
    """A job restarted from checkpoint-6: HF's rotation then removes the first process's
    checkpoint-6, and the relaunch's save at step 8 overwrites the first one's. Until 2026-11-29 the
    relaunch never looked at the first process's saves, and the rollback query named checkpoint-6
    (gone) for a divergence before step 8. Rank 0's ledger beside the spool carries them over."""
    from trainvitals.service.store import queries

    _run(tmp_path, name="rotated", max_steps=8, save_steps=2, save_total_limit=2, collector=collector.url)
    out = tmp_path / "out"
    _, callback, _, _ = _run(tmp_path, name="rotated", max_steps=12, save_steps=2, save_total_limit=2,
                             collector=collector.url, resume_from=str(out / "checkpoint-6"))  # fmt: skip
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-10", "checkpoint-12"
    ]  # fmt: skip
    assert callback._errors.errors == 0
    with collector.app.state.sessionmaker() as session:
        gens = queries.checkpoint_generations(session, run_id="hf-rotated")
        before_7 = queries.rollback_target(session, run_id="hf-rotated", before_step=7)
        before_11 = queries.rollback_target(session, run_id="hf-rotated", before_step=11)
    first, relaunch = sorted({g["incarnation"] for g in gens})
    assert [(g["step"], g["incarnation"] == relaunch, g["status"]) for g in gens] == [
        (2, False, "deleted"), (4, False, "deleted"), (6, False, "deleted"), (8, False, "deleted"),
        (8, True, "deleted"), (10, True, "verified"), (12, True, "verified"),
    ]  # fmt: skip
    overwritten = next(g for g in gens if g["step"] == 8 and g["incarnation"] == first)
    assert any("overwritten at the same path by generation 8" in e for e in overwritten["errors"])
    assert before_7["target"] is None
    assert (before_11["target"]["step"], before_11["target"]["path"]) == (10, str(out / "checkpoint-10"))


def test_a_jit_checkpoint_saved_on_sigterm_is_a_generation(tmp_path: Path) -> None:
    """enable_jit_checkpoint: after SIGTERM the Trainer saves checkpoint-N itself, without on_save,
    and stops: until 2026-12-04 that save, the one a preempted job resumes from, was not recorded.
    Now train()'s end records the complete checkpoint-N directories it wrote and did not announce."""
    _, callback, records, _ = _run(tmp_path, name="jit", max_steps=12, save_steps=100, preempt_at=5)
    assert [r.step for r in records if r.kind == "step"] == [1, 2, 3, 4, 5, 6]  # stopped after the save
    saves = [(c.step, c.status, Path(c.path).name) for c in records if c.kind == "checkpoint"]  # type: ignore[arg-type]
    assert saves == [(5, "persisted", "checkpoint-5")]
    assert Path(next(c.path for c in records if c.kind == "checkpoint")) == tmp_path / "out" / "checkpoint-5"
    assert callback._errors.errors == 0
