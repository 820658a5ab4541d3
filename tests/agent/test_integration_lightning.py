"""Lightning callback: real short CPU `Trainer.fit` runs of a tiny random model, no downloads.

Every assertion compares what the agent recorded with what the LightningModule itself saw.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as lp
import pytest
import pytorch_lightning
import torch
from torch import nn

from trainvitals.agent import AgentConfig
from trainvitals.agent.integrations.lightning import TrainvitalsLightningCallback
from trainvitals.wire import Batch, RunRegistration

BATCH, SEQ, VOCAB = 4, 8, 32


def _data() -> torch.utils.data.DataLoader:
    ids = torch.randint(0, VOCAB, (256, SEQ), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)


def _module_class(namespace: Any) -> type:
    """A tiny next-token model that records, per batch, the loss and lr it really used."""

    class TinyLM(namespace.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
            self.emb = nn.Embedding(VOCAB, 16)
            self.head = nn.Linear(16, VOCAB)
            self.seen: list[tuple[float, float]] = []  # (loss, lr) per batch, read here in the test
            self.grad_norms: list[float] = []  # per optimizer step, when Lightning says grads are final

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            h = self.emb(ids[:, :-1])
            for layer in self.layers:
                h = torch.relu(layer(h))
            loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids[:, 1:].flatten())
            self.seen.append((loss.item(), self.trainer.optimizers[0].param_groups[0]["lr"]))
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyLM


def _fit(
    tmp: Path,
    *,
    name: str,
    max_steps: int = 12,
    accumulate: int = 1,
    namespace: Any = lp,
    ckpt_path: str | None = None,
    save_to: Path | None = None,
    collector: str = "",
    plugins: list[Any] | None = None,
    checkpoint: Any = None,
    strategy: Any = "auto",
    extra: list[Any] | None = None,
    run: str | None = None,
) -> tuple[Any, TrainvitalsLightningCallback, list[Any], RunRegistration]:
    torch.manual_seed(0)
    module = _module_class(namespace)()
    config = AgentConfig(
        collector=collector, record_file=str(tmp / f"{name}-{{rank}}.jsonl"), spill_dir=str(tmp / "spool")
    )
    callback = TrainvitalsLightningCallback(
        run=run or f"pl-{name}", config=config, count_tokens=lambda b: b[0].numel()
    )
    trainer = namespace.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=checkpoint is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, *([] if checkpoint is None else [checkpoint]), *(extra or [])],
        plugins=plugins,
        strategy=strategy,
    )
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    lines = (tmp / f"{name}-0.jsonl").read_bytes().splitlines()
    registration = RunRegistration.model_validate_json(lines[0])
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    return module, callback, records, registration


def test_one_step_record_per_optimizer_step_matching_what_the_module_saw(tmp_path: Path) -> None:
    module, callback, records, registration = _fit(tmp_path, name="basic")
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(12))  # Lightning's logger numbering
    assert [s.loss for s in steps] == pytest.approx([loss for loss, _ in module.seen], rel=1e-6)
    assert all(s.loss is not None and math.isfinite(s.loss) for s in steps)
    assert [s.lr for s in steps] == pytest.approx([lr for _, lr in module.seen], rel=1e-12)
    assert steps[0].lr == 0.5 and steps[-1].lr == pytest.approx(0.5 * 0.9**11)
    assert all(s.tokens == BATCH * SEQ for s in steps)

    # This step's gradients, not the previous step's: Lightning runs backward inside
    # optimizer.step(closure), after a plain step pre-hook would have read them.
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [g.step for g in grads] == list(range(12))
    assert [math.sqrt(g.owned_sq) for g in grads] == pytest.approx(module.grad_norms, rel=1e-5)
    assert {r.group for r in records if r.kind == "grad"} >= {"layers.0", "layers.1", "head", "emb"}

    events = [r for r in records if r.kind == "event"]
    assert events[0].event == "start" and events[-1].event == "stop"
    assert [e.event for e in events] == ["start", "stop"]
    assert registration.run == "pl-basic" and registration.tags["framework"] == "lightning"

    optimizer = module.trainer.optimizers[0]
    assert len(optimizer._optimizer_step_pre_hooks) == 0
    assert callback.agent is not None and callback.agent.hooks == 0
    assert callback._grad_hooks is not None and callback._grad_hooks.hooks == 0
    assert callback._errors.errors == 0


def test_gradient_accumulation_gives_one_record_per_optimizer_step(tmp_path: Path) -> None:
    module, _, records, _ = _fit(tmp_path, name="accum", max_steps=4, accumulate=3)
    assert len(module.seen) == 12  # 12 batches, 4 optimizer steps
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == [0, 1, 2, 3]
    for i, s in enumerate(steps):
        micro = [loss for loss, _ in module.seen[3 * i : 3 * i + 3]]
        assert s.loss == pytest.approx(sum(micro) / 3, rel=1e-6)  # the step's mean loss
        assert s.tokens == 3 * BATCH * SEQ
        assert s.lr == pytest.approx(0.5 * 0.9**i)
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [g.step for g in grads] == [0, 1, 2, 3]
    assert [math.sqrt(g.owned_sq) for g in grads] == pytest.approx(module.grad_norms, rel=1e-5)


def test_steps_an_fp16_loss_scaler_skipped_are_sent_as_skipped(tmp_path: Path) -> None:
    """Lightning counts a step whose update the GradScaler skipped (inf/NaN gradients) and fires
    on_before_optimizer_step for it; only the optimizer's own step tells them apart. Real fp16
    autocast on CPU; the scaler starts at 2**24, so its first steps overflow, as fp16 jobs' first
    steps do with the default 2**16 on larger models."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=1000)
    precision = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    module, _, records, _ = _fit(tmp_path, name="fp16", max_steps=40, plugins=[precision])
    # The scaler skips exactly the steps whose unscaled gradients the module saw non-finite.
    skipped_by_scaler = [not math.isfinite(norm) for norm in module.grad_norms]
    assert 3 <= sum(skipped_by_scaler) < 40  # some overflowed, and training went on after them
    assert scaler.get_scale() == 2.0 ** (24 - sum(skipped_by_scaler))  # halved once per skip
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(40))
    assert [s.skipped for s in steps] == skipped_by_scaler


def test_resume_from_checkpoint_is_an_event_and_step_numbers_continue(tmp_path: Path) -> None:
    ckpt = tmp_path / "six.ckpt"
    _, _, first, _ = _fit(tmp_path, name="first", max_steps=6, save_to=ckpt)
    # save_checkpoint after fit: the agent is closed, nothing more is recorded.
    assert not any(r.kind == "event" and r.event == "note" for r in first)
    module, _, records, _ = _fit(tmp_path, name="resumed", max_steps=12, ckpt_path=str(ckpt))
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(6, 12))
    assert [s.loss for s in steps] == pytest.approx([loss for loss, _ in module.seen], rel=1e-6)
    resumes = [r for r in records if r.kind == "event" and r.event == "resume"]
    assert len(resumes) == 1 and resumes[0].step == 5
    assert str(ckpt) in (resumes[0].detail or "")


def test_the_same_callback_works_with_the_standalone_pytorch_lightning_trainer(tmp_path: Path) -> None:
    module, callback, records, _ = _fit(tmp_path, name="legacy", max_steps=3, namespace=pytorch_lightning)
    assert isinstance(callback, lp.Callback) and isinstance(callback, pytorch_lightning.Callback)
    assert [r.step for r in records if r.kind == "step"] == [0, 1, 2]
    assert len(module.trainer.optimizers[0]._optimizer_step_pre_hooks) == 0


def test_a_failing_fit_records_the_failure_and_removes_the_hook(tmp_path: Path) -> None:
    class Boom(RuntimeError):
        pass

    TinyLM = _module_class(lp)

    class Failing(TinyLM):  # type: ignore[misc, valid-type]
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 3:
                raise Boom("loss exploded")
            return super().training_step(batch, batch_idx)

    config = AgentConfig(
        collector="", record_file=str(tmp_path / "boom-{rank}.jsonl"), spill_dir=str(tmp_path)
    )
    callback = TrainvitalsLightningCallback(run="pl-boom", config=config)
    module = Failing()
    trainer = lp.Trainer(
        max_steps=12,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    with pytest.raises(Boom):
        trainer.fit(module, _data())
    lines = (tmp_path / "boom-0.jsonl").read_bytes().splitlines()
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    assert [r.step for r in records if r.kind == "step"] == [0, 1, 2]
    events = [r for r in records if r.kind == "event"]
    assert [e.event for e in events] == ["start", "failure", "stop"]
    assert "Boom: loss exploded" in (events[1].detail or "")
    assert len(trainer.optimizers[0]._optimizer_step_pre_hooks) == 0


def test_steps_reach_a_real_collector(collector: Any, tmp_path: Path) -> None:
    from trainvitals.service.store import queries

    _fit(tmp_path, name="live", max_steps=8, collector=collector.url)
    with collector.app.state.sessionmaker() as session:
        assert queries.count_step_rows(session, run_id="pl-live") == 8
        assert queries.list_runs(session)[0].status == "finished"


def _written(records: list[Any]) -> list[tuple[int, str, str]]:
    """Checkpoint records by step, each file's in the order sent: a file's persisted record comes
    from the checksum thread, and under load it may follow the next file's started record."""
    written = [(r.step, r.status, Path(r.path).name) for r in records if r.kind == "checkpoint"]
    return sorted(written, key=lambda w: w[0])


def test_each_checkpoint_lightning_writes_is_a_generation_rollback_can_name(collector: Any, tmp_path: Path) -> None:
    """ModelCheckpoint's files were recorded only as notes (from every rank, before the write, without
    the path): no generation, so `query rollback` answered "none" for every Lightning run and the
    cadence advisor had no write time. Now each write is a generation, numbered by the last step
    the file holds (what the resume's loaded() continues after)."""
    import hashlib

    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainvitals.service.store import queries

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    module, _, records, _ = _fit(tmp_path, name="saves", max_steps=12, checkpoint=saver, collector=collector.url)
    names = ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "epoch=0-step=12.ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(names)
    steps = zip((3, 7, 11), names, strict=True)
    assert _written(records) == [(step, status, name) for step, name in steps for status in ("started", "persisted")]
    assert not any(r.kind == "event" and r.event == "note" for r in records)
    for r in (r for r in records if r.kind == "checkpoint" and r.status == "persisted"):
        data = Path(r.path).read_bytes()
        assert r.bytes == len(data) and r.checksum == "sha256:" + hashlib.sha256(data).hexdigest()
        assert r.stall_seconds is not None and r.stall_seconds > 0
    # The job's own CheckpointIO is back on the strategy once fit() has ended.
    assert type(module.trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"

    with collector.app.state.sessionmaker() as session:
        answer = queries.rollback_target(session, run_id="pl-saves")
        gens = queries.checkpoint_generations(session, run_id="pl-saves")
    assert [(g["step"], g["status"]) for g in gens] == [(3, "verified"), (7, "verified"), (11, "verified")]
    assert answer["target"]["path"] == str(tmp_path / "ckpt" / names[-1]) and answer["verified"]


def test_a_resumed_fit_retires_the_first_fits_files_save_top_k_removed(collector: Any, tmp_path: Path) -> None:
    """ModelCheckpoint's state comes back with the resume, and its save_top_k then removes the first
    fit's files: until 2026-11-29 only the resumed fit's own saves were checked, and the rollback
    query named the first fit's removed files. Rank 0's ledger beside the spool carries them over.
    (Lightning keeps the file a fit resumed from: step 6 stays.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainvitals.service.store import queries

    def saver() -> Any:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=2, monitor="step",
                               mode="max")  # fmt: skip

    _fit(tmp_path, name="first", run="pl-resumed", max_steps=6, checkpoint=saver(), collector=collector.url)
    resume_from = str(tmp_path / "ckpt" / "epoch=0-step=6.ckpt")
    _, callback, records, _ = _fit(tmp_path, name="second", run="pl-resumed", max_steps=12, checkpoint=saver(),
                                   collector=collector.url, ckpt_path=resume_from)  # fmt: skip
    kept = ["epoch=0-step=10.ckpt", "epoch=0-step=12.ckpt", "epoch=0-step=6.ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == kept
    assert sorted((r.generation, r.saved_by_incarnation is not None) for r in records
                  if r.kind == "checkpoint" and r.status == "deleted") == [(3, True), (7, False)]  # fmt: skip
    with collector.app.state.sessionmaker() as session:
        gens = queries.checkpoint_generations(session, run_id="pl-resumed")
        before_5 = queries.rollback_target(session, run_id="pl-resumed", before_step=5)
        before_9 = queries.rollback_target(session, run_id="pl-resumed", before_step=9)
    assert [(g["step"], g["status"]) for g in gens] == [
        (1, "deleted"), (3, "deleted"), (5, "verified"), (7, "deleted"), (9, "verified"), (11, "verified")
    ]  # fmt: skip
    assert before_5["target"] is None
    assert before_9["target"]["path"] == str(tmp_path / "ckpt" / "epoch=0-step=6.ckpt")
    assert callback._errors.errors == 0


def test_layers_unfrozen_during_fit_count_in_the_gradient_norm(tmp_path: Path) -> None:
    """A backbone frozen before fit and unfrozen at step 6 (what BaseFinetuning does, with an
    optimizer over every parameter): until 2026-11-29 the agent watched only the parameters that
    were trainable when it attached, and from step 6 on its global norm left the layers out."""

    class UnfreezeAtStep6(lp.Callback):  # type: ignore[misc]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pl_module.layers.requires_grad_(False)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 6:
                pl_module.layers.requires_grad_(True)

    module, _, records, _ = _fit(tmp_path, name="unfreeze", extra=[UnfreezeAtStep6()])
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [g.step for g in grads] == list(range(12))
    assert [math.sqrt(g.owned_sq) for g in grads] == pytest.approx(module.grad_norms, rel=1e-5)
    layer_steps = sorted({r.step for r in records if r.kind == "grad" and r.group.startswith("layers.")})
    assert layer_steps == list(range(6, 12))  # no gradient before the unfreeze: no record, not a 0


def test_an_async_checkpoint_io_write_is_persisted_when_its_thread_wrote_it(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    _, callback, records, _ = _fit(
        tmp_path, name="async", max_steps=10, checkpoint=saver, plugins=[AsyncCheckpointIO()]
    )
    written = _written(records)  # a write may end after the next one started: order per file
    for step, name in ((4, "epoch=0-step=5.ckpt"), (9, "epoch=0-step=10.ckpt")):
        assert [w for w in written if w[0] == step] == [(step, "started", name), (step, "persisted", name)]
    assert len(written) == 4  # the last one too: close() waits for the plugin's thread
    for r in (r for r in records if r.kind == "checkpoint" and r.status == "persisted"):
        assert r.bytes == Path(r.path).stat().st_size > 0
        assert r.persist_seconds >= r.stall_seconds  # durable when the plugin's thread had written it
    assert callback._errors.errors == 0


def test_a_strategy_that_writes_its_own_checkpoints_is_said_once(tmp_path: Path, caplog: Any) -> None:
    """FSDP's sharded state dict and DeepSpeed write without Lightning's CheckpointIO: nothing to
    record there, and the user is told so instead of finding no generation at rollback time."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class WritesItself(lp.strategies.SingleDeviceStrategy):  # type: ignore[misc]
        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            Path(filepath).parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, filepath)

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    with caplog.at_level("WARNING", logger="trainvitals"):
        _, _, records, _ = _fit(
            tmp_path, name="own", max_steps=9, checkpoint=saver, strategy=WritesItself(torch.device("cpu"))
        )
    assert len(list((tmp_path / "ckpt").iterdir())) == 3 and _written(records) == []
    said = [r.getMessage() for r in caplog.records if "CheckpointIO" in r.getMessage()]
    assert said == [
        "trainvitals agent: WritesItself saved a checkpoint without Lightning's CheckpointIO: it is not recorded "
        "as a checkpoint generation, so `trainvitals query rollback` cannot name it; record your saves with "
        "`with callback.agent.checkpoint(step=..., path=...)` around them"
    ]


def _crashing_fit(tmp: Path, name: str, checkpoint: Any, *, crash_at: int = 3) -> tuple[Any, Any, list[Any]]:
    """A fit whose training_step raises at batch `crash_at`; returns the trainer, the callback and the records."""

    class Boom(RuntimeError):
        pass

    class Failing(_module_class(lp)):  # type: ignore[misc]
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == crash_at:
                raise Boom("loss exploded")
            return super().training_step(batch, batch_idx)

    config = AgentConfig(collector="", record_file=str(tmp / f"{name}-{{rank}}.jsonl"), spill_dir=str(tmp / "spool"))
    callback = TrainvitalsLightningCallback(run=f"pl-{name}", config=config)
    trainer = lp.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback, checkpoint])  # fmt: skip
    torch.manual_seed(0)
    with pytest.raises(Boom):
        trainer.fit(Failing(), _data())
    lines = (tmp / f"{name}-0.jsonl").read_bytes().splitlines()
    return trainer, callback, [r for line in lines[1:] for r in Batch.model_validate_json(line).records]


def test_the_checkpoint_saved_on_a_crash_is_a_recorded_generation(tmp_path: Path) -> None:
    """ModelCheckpoint(save_on_exception=True) saves in its on_exception, which Lightning calls after
    ours (checkpoint callbacks run last). Until 2026-12-04 the callback closed the agent and gave
    the strategy its own CheckpointIO back in on_exception: the crash's checkpoint, the one a
    restart resumes from, had no generation. A failed fit calls no callback's teardown, only the
    strategy's, which is where the agent is closed now."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=100, save_on_exception=True)
    trainer, callback, records = _crashing_fit(tmp_path, "crash-save", saver)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len(files) == 1
    assert _written(records) == [(2, "started", files[0]), (2, "persisted", files[0])]  # holds steps 0-2
    assert [e.event for e in records if e.kind == "event"] == ["start", "failure", "stop"]
    assert type(trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"  # the job's own again
    assert len(trainer.optimizers[0]._optimizer_step_pre_hooks) == 0
    assert callback.agent is not None and callback.agent.hooks == 0
    assert callback._errors.errors == 0


def test_the_save_last_checkpoint_written_at_train_end_is_recorded(tmp_path: Path) -> None:
    """ModelCheckpoint(save_last=True) writes last.ckpt in its on_train_end, after ours: until
    2026-12-04 the agent was closed by then."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=100, save_last=True)
    module, callback, records, _ = _fit(tmp_path, name="last", max_steps=6, checkpoint=saver)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert _written(records) == [(5, "started", "last.ckpt"), (5, "persisted", "last.ckpt")]
    assert type(module.trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"
    assert callback.agent is not None and callback.agent.hooks == 0
    assert callback._errors.errors == 0


class _ZeroLikeOptimizer:
    """Stands in for DeepSpeed's ZeRO optimizer (DeepSpeed is not installed here and needs a GPU):
    what Lightning's DeepSpeed strategy puts in trainer.optimizers is no torch Optimizer, takes no
    step hooks, and holds the torch optimizer it steps as `.optimizer`."""

    def __init__(self, inner: torch.optim.Optimizer | None, params: Any = None) -> None:
        self.optimizer = inner
        self._own = inner or torch.optim.SGD(params, lr=0.5)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._own.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self._own.defaults

    @property
    def state(self) -> Any:
        return self._own.state

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self._own.step()  # the torch optimizer's update: its step pre-hooks run
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._own.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._own.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._own.load_state_dict(state_dict)


@pytest.mark.parametrize("holds_torch_optimizer", [True, False])
def test_an_optimizer_without_step_hooks_still_gets_every_step_recorded(
    tmp_path: Path, caplog: Any, holds_torch_optimizer: bool
) -> None:
    """Lightning's DeepSpeed strategy: trainer.optimizers[0] has no register_step_pre_hook. Until
    2026-12-04 the AttributeError ended on_train_start before attach(): no agent for the whole fit."""

    class WrappedOptimizer(_module_class(lp)):  # type: ignore[misc]
        def configure_optimizers(self) -> Any:
            if holds_torch_optimizer:
                return _ZeroLikeOptimizer(torch.optim.SGD(self.parameters(), lr=0.5))
            return _ZeroLikeOptimizer(None, self.parameters())

    config = AgentConfig(collector="", record_file=str(tmp_path / "zero-{rank}.jsonl"), spill_dir=str(tmp_path))
    callback = TrainvitalsLightningCallback(run="pl-zero", config=config)
    module = WrappedOptimizer()
    trainer = lp.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])  # fmt: skip
    with caplog.at_level("WARNING", logger="trainvitals"):
        trainer.fit(module, _data())
    lines = (tmp_path / "zero-0.jsonl").read_bytes().splitlines()
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == [0, 1, 2, 3]
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [math.sqrt(g.owned_sq) for g in grads] == pytest.approx(module.grad_norms, rel=1e-5)
    said = [r.getMessage() for r in caplog.records if "takes no step hooks" in r.getMessage()]
    if holds_torch_optimizer:  # its torch optimizer's hook tells applied steps: none skipped
        assert said == [] and not any(s.skipped for s in steps)
        assert len(trainer.optimizers[0].optimizer._optimizer_step_pre_hooks) == 0
    else:
        assert said == [
            "trainvitals agent: _ZeroLikeOptimizer takes no step hooks and holds no torch optimizer as .optimizer:"
            " steps are recorded with their gradient norms, but a step whose update was skipped (a loss"
            " scaler's inf/NaN skip) is not told apart"
        ]
    assert callback.agent is not None and callback.agent.hooks == 0
    assert callback._errors.errors == 0


def test_fp16_with_a_fused_optimizer_reports_unscaled_gradient_norms(tmp_path: Path) -> None:
    """Lightning leaves unscaling to an optimizer that unscales in its own step (AdamW(fused=True)):
    at on_before_optimizer_step the gradients still hold the loss scale. Until 2026-12-04 the norms
    were sent 2**10 times too large here. Real fp16 autocast and a fused AdamW on CPU."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Fused(_module_class(lp)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.scales: list[float] = []

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            super().on_before_optimizer_step(optimizer)  # the scaled gradients' norm
            self.scales.append(self.trainer.precision_plugin.scaler.get_scale())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    config = AgentConfig(collector="", record_file=str(tmp_path / "fused-{rank}.jsonl"), spill_dir=str(tmp_path))
    callback = TrainvitalsLightningCallback(run="pl-fused", config=config)
    module = Fused()
    trainer = lp.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])  # fmt: skip
    trainer.fit(module, _data())
    lines = (tmp_path / "fused-0.jsonl").read_bytes().splitlines()
    records = [r for line in lines[1:] for r in Batch.model_validate_json(line).records]
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [g.step for g in grads] == list(range(6))
    assert all(math.isfinite(n) for n in module.grad_norms) and set(module.scales) == {2.0**10}
    unscaled = [n / s for n, s in zip(module.grad_norms, module.scales, strict=True)]
    assert [math.sqrt(g.owned_sq) for g in grads] == pytest.approx(unscaled, rel=1e-4)
    assert callback._errors.errors == 0


def test_a_count_tokens_that_raises_costs_the_tokens_not_the_steps(tmp_path: Path, caplog: Any) -> None:
    """The user's count_tokens ran inside the guarded hook before agent.step: one that raised (here
    on odd batches) lost those steps' records altogether, loss and gradient norm included."""

    def count(batch: list[torch.Tensor]) -> int:
        if int(batch[0][0, 0]) % 2:
            raise KeyError("input_ids")
        return batch[0].numel()

    config = AgentConfig(collector="", record_file=str(tmp_path / "count-{rank}.jsonl"), spill_dir=str(tmp_path))
    callback = TrainvitalsLightningCallback(run="pl-count", config=config, count_tokens=count)
    module = _module_class(lp)()
    trainer = lp.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])  # fmt: skip
    with caplog.at_level("WARNING", logger="trainvitals"):
        trainer.fit(module, _data())
    lines = (tmp_path / "count-0.jsonl").read_bytes().splitlines()
    steps = [r for line in lines[1:] for r in Batch.model_validate_json(line).records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(8))
    assert [s.loss for s in steps] == pytest.approx([loss for loss, _ in module.seen], rel=1e-6)
    firsts = [int(ids[0, 0]) for (ids,), _ in zip(_data(), range(8), strict=False)]
    assert [s.tokens for s in steps] == [None if f % 2 else BATCH * SEQ for f in firsts]
    assert 0 < sum(f % 2 for f in firsts) < 8
    said = [r.getMessage() for r in caplog.records if "count_tokens" in r.getMessage()]
    assert said == [
        "trainvitals agent: count_tokens(batch) raised KeyError: 'input_ids'; steps where it raises are recorded"
        " without tokens (and without FLOPs or MFU)"
    ]
    assert callback._errors.errors == 0


def test_a_tensor_token_count_is_summed_on_the_device_not_read_per_batch(tmp_path: Path) -> None:
    """count_tokens=lambda b: mask.sum() returns a tensor: int() of it was a device sync per batch.
    It is now summed as a tensor over the step's batches and read back with the loss."""
    seen: list[Any] = []

    def count(batch: list[torch.Tensor]) -> torch.Tensor:
        n = (batch[0] >= 0).sum()
        seen.append(n)
        return n

    config = AgentConfig(collector="", record_file=str(tmp_path / "tt-{rank}.jsonl"), spill_dir=str(tmp_path))
    callback = TrainvitalsLightningCallback(run="pl-tt", config=config, count_tokens=count)
    trainer = lp.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])  # fmt: skip
    calls: list[Any] = []
    original = torch.Tensor.__int__

    def spy(self: torch.Tensor) -> int:
        if any(self is s for s in seen):
            calls.append(self)
        return original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "__int__", spy)
        trainer.fit(_module_class(lp)(), _data())
    assert calls == []  # never read on the training thread
    lines = (tmp_path / "tt-0.jsonl").read_bytes().splitlines()
    steps = [r for line in lines[1:] for r in Batch.model_validate_json(line).records if r.kind == "step"]
    assert [(s.step, s.tokens) for s in steps] == [(0, 2 * BATCH * SEQ), (1, 2 * BATCH * SEQ), (2, 2 * BATCH * SEQ)]
    assert callback._errors.errors == 0
