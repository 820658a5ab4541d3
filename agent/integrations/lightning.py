"""PyTorch Lightning integration: one callback, no changes to the LightningModule.

Works with the `lightning` package (`lightning.pytorch`) and with the standalone `pytorch_lightning`
package. Importing this module imports Lightning; `trainvitals.agent` itself never does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from trainvitals.agent._agent import attach
from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget, guarded, warn_once
from trainvitals.agent._optimizer import hookable_optimizer
from trainvitals.agent._protocol import TrainingAgent

# `lightning.pytorch.Callback` and `pytorch_lightning.Callback` are distinct classes (the same code
# shipped twice) and each Trainer only accepts its own. `pip install lightning` also installs
# `pytorch_lightning`, so subclass every namespace present: one callback works with either Trainer.
_CALLBACK_BASES: list[type] = []
try:
    import lightning.pytorch as pl

    _CALLBACK_BASES.append(pl.Callback)
except ImportError:  # only the standalone package is installed
    import pytorch_lightning as pl  # type: ignore[no-redef]
try:
    import pytorch_lightning as _pl_standalone

    if _pl_standalone.Callback not in _CALLBACK_BASES:
        _CALLBACK_BASES.append(_pl_standalone.Callback)
except ImportError:
    pass


class _GradsReadyHooks:
    """Stands in for the optimizer when the agent registers its step pre-hook, and fires that hook
    from Lightning's on_before_optimizer_step instead.

    Why: Lightning runs forward and backward inside `optimizer.step(closure)`, so a real step
    pre-hook fires before this step's backward and would read the previous step's gradients.
    on_before_optimizer_step runs once per optimizer step after the closure (and after AMP
    unscaling, before gradient clipping): the gradients are final there. Everything else the
    agent may ask of the optimizer goes to the real one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # An OrderedDict, as in torch: RemovableHandle keeps a weak reference to it. Named as torch
        # names its registry, which is how the agent tells an object that takes step hooks.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        handle = RemovableHandle(self._optimizer_step_pre_hooks)
        self._optimizer_step_pre_hooks[handle.id] = hook
        return handle

    def fire(self) -> None:
        for hook in tuple(self._optimizer_step_pre_hooks.values()):
            hook(self.optimizer, (), {})

    @property
    def hooks(self) -> int:
        return len(self._optimizer_step_pre_hooks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _RecordedCheckpointIO:
    """Stands in for the strategy's CheckpointIO while the agent is attached: each checkpoint file
    Lightning writes through it (ModelCheckpoint, `trainer.save_checkpoint`; on DDP, global rank 0
    writes) becomes a checkpoint generation (started, then persisted or failed, with the stall, the
    size and a checksum), which `trainvitals query rollback` and the cadence advisor read.
    Everything else goes to the real one.

    Why not on_save_checkpoint: Lightning calls it while building the checkpoint dict, on every
    rank, before anything is written and without the path; the write is here.

    Its teardown (the strategy's, after every callback hook of the fit, the failed fit's
    on_exception ones included) is where the callback closes the agent: `on_teardown`.
    """

    def __init__(self, inner: Any, agent: TrainingAgent, on_teardown: Callable[[], None]) -> None:
        self.inner = inner
        self.agent = agent
        self.writes = 0
        self.on_teardown = on_teardown

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.writes += 1
        # The state holds `global_step` optimizer steps, numbered from 0 as the step records are:
        # the last of them is the step a resume continues after (on_train_start's loaded()).
        step = max(int(checkpoint.get("global_step", 0)) - 1, 0)
        with self.agent.checkpoint(step=step, path=path) as handle:
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
            handle.track(_async_write_done(self.inner))

    def teardown(self) -> None:
        try:
            self.inner.teardown()  # AsyncCheckpointIO: waits for its queued writes
        finally:
            self.on_teardown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _async_write_done(io: Any) -> Future[None] | None:
    """For Lightning's AsyncCheckpointIO (its one worker thread writes in order): a future that
    completes after the write just queued, failing as it failed. None: the write is done."""
    executor = getattr(io, "_executor", None)
    if not isinstance(executor, ThreadPoolExecutor) or not hasattr(io, "_error"):
        return None

    def written() -> None:
        if io._error is not None:
            raise io._error

    try:
        return executor.submit(written)
    except RuntimeError:  # shut down meanwhile: nothing is queued behind it, so the write is done
        return None


def _loss_tensor(outputs: Any) -> torch.Tensor | None:
    """The loss in what training_step returned: a tensor, or a mapping with a 'loss' key."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def _unscaled_loss_scale(trainer: Any, optimizer: Any) -> torch.Tensor | None:
    """The loss scale the gradients still hold at on_before_optimizer_step, else None. fp16 AMP
    unscales before that hook, except for an optimizer that unscales inside its own step (a fused
    Adam: `_step_supports_amp_scaling`), which Lightning leaves scaled. The scale stays a device
    tensor (read without a sync; scaler.update() changes it only after the step)."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    scale = getattr(scaler, "_scale", None)  # torch's GradScaler keeps it here, set at scale()
    return scale if isinstance(scale, torch.Tensor) else None


def _current_lr(optimizer: torch.optim.Optimizer) -> float | None:
    if not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        # A tensor lr on an accelerator would need a sync to read; skip it rather than stall the step.
        return float(lr) if lr.device.type == "cpu" else None
    return float(lr) if lr is not None else None


class TrainvitalsLightningCallback(*_CALLBACK_BASES):  # type: ignore[misc]
    """Attaches the trainvitals agent to a Lightning `Trainer.fit` run.

    Usage::

        from trainvitals.agent.integrations.lightning import TrainvitalsLightningCallback

        trainer = lightning.pytorch.Trainer(
            max_steps=10_000,
            callbacks=[TrainvitalsLightningCallback(run="gpt-7b-0412",
                                                    count_tokens=lambda b: b["input_ids"].numel())],
        )
        trainer.fit(module, datamodule)

    One step record per optimizer step (with `accumulate_grad_batches=k`, one per k batches). The
    step number is the one Lightning's loggers use for that step (`trainer.global_step` before the
    step's increment: 0, 1, 2, ...), so a spike on the dashboard and in TensorBoard/W&B carry the
    same number. Loss: the step's loss as Lightning computed it (automatic optimization: the sum of
    the micro-batches' normalized losses, i.e. their mean), kept on device. lr: the one the
    optimizer used for this step. tokens: `count_tokens(batch)` summed over the step's batches,
    when given (it should read shapes only, never values, to stay sync free; a one-element tensor
    it returns is summed on the device and read back with the loss). A count_tokens that raises
    is said once; the steps where it raised are recorded without tokens.

    Gradient norms: of `trainer.optimizers[0]`'s step (the only optimizer in automatic
    optimization), read when Lightning's on_before_optimizer_step fires, i.e. after backward and
    AMP unscaling, before Lightning's gradient clipping (see `_GradsReadyHooks` for why not at
    optimizer.step). With fp16 and an optimizer that unscales inside its own step (a fused Adam),
    Lightning does not unscale first: the norms are divided by the scaler's scale on the device
    (no sync). The optimizer itself gets one step pre-hook (on the torch optimizer DeepSpeed's
    holds as `.optimizer`), which only notes that it stepped: a loss scaler (fp16's GradScaler)
    skips optimizer.step() on inf/NaN gradients while Lightning still counts the step, and such a
    step is sent as skipped, not as a divergence. A fused optimizer skips inside its step, which
    the hook cannot see: those steps are not sent as skipped. An optimizer with no torch
    optimizer to hook is said once, and no step is called skipped.

    Checkpoints: each file Lightning writes through its CheckpointIO (ModelCheckpoint,
    `trainer.save_checkpoint`, with any CheckpointIO plugin, AsyncCheckpointIO included) is a
    checkpoint generation numbered by the last step it holds; strategies that write their own
    files (FSDP's sharded state dict, DeepSpeed) are said once, not recorded.

    Also: a `resume` event when fit() starts from a checkpoint, a `failure` event when fit()
    raises, and close() (flush, hooks removed) when fit() ends: at the strategy's teardown, after
    every callback hook, so the checkpoint saved on the exception (`save_on_exception`,
    OnExceptionCheckpoint) or save_last's at on_train_end is recorded too.
    """

    def __init__(
        self,
        *,
        run: str | None = None,
        project: str | None = None,
        collector: str | None = None,
        config: AgentConfig | None = None,
        registration: dict[str, Any] | None = None,
        count_tokens: Callable[[Any], int | torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.run = run
        self.project = project
        self.collector = collector
        self.config = config
        self.registration = registration
        self.count_tokens = count_tokens
        self.agent: TrainingAgent | None = None
        """The agent of the current (or last) fit(); kept after close for stats()."""
        self._errors = ErrorBudget()
        self._attached = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._grad_hooks: _GradsReadyHooks | None = None
        self._applied_hook: RemovableHandle | None = None
        self._applied = False  # the optimizer stepped since the last step record
        self._last_global_step = 0
        self._loss: torch.Tensor | None = None
        self._tokens: Any = None  # this step's count so far: a number or a device tensor
        self._tokens_failed = False  # count_tokens raised on one of this step's batches
        self._lr: float | None = None
        self._strategy: Any = None
        self._recorded_io: _RecordedCheckpointIO | None = None
        self._writes_at_save: int | None = None  # the recorded writes when a save began (global rank 0)
        self._said: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ attach / close

    def _registration(self, trainer: pl.Trainer) -> dict[str, Any]:
        auto: dict[str, Any] = {
            "tags": {"framework": "lightning", "framework_version": str(pl.__version__)},
        }
        accumulate = getattr(trainer, "accumulate_grad_batches", None)
        if isinstance(accumulate, int) and accumulate > 1:
            auto["tags"]["accumulate_grad_batches"] = str(accumulate)
        out = dict(auto)
        for key, value in (self.registration or {}).items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
        return out

    def _record_checkpoint_writes(self, trainer: pl.Trainer) -> None:
        assert self.agent is not None
        strategy = trainer.strategy
        io = strategy.checkpoint_io  # resolved by the strategy (its default, or the job's plugin)
        if isinstance(io, _RecordedCheckpointIO):  # left by an earlier fit that did not end cleanly
            io = io.inner
        self._strategy, self._recorded_io = strategy, _RecordedCheckpointIO(io, self.agent, self._teardown_close)
        strategy.checkpoint_io = cast(Any, self._recorded_io)  # duck-typed: the strategy only calls its methods

    def _check_save_recorded(self) -> None:
        """A save Lightning made without its CheckpointIO (FSDP's sharded state dict, DeepSpeed
        write their own files) is not a recorded generation: said once, with what to do."""
        began, self._writes_at_save = self._writes_at_save, None
        if began is None or self._recorded_io is None or self._recorded_io.writes > began:
            return
        strategy = type(self._strategy).__name__
        warn_once(
            self._said,
            ("lightning", "checkpoint unrecorded"),
            f"{strategy} saved a checkpoint without Lightning's CheckpointIO: it is not recorded as a checkpoint "
            "generation, so `trainvitals query rollback` cannot name it; record your saves with "
            "`with callback.agent.checkpoint(step=..., path=...)` around them",
        )

    def _close(self) -> None:
        self._check_save_recorded()
        if self._attached and self.agent is not None:
            self.agent.close()
        self._attached = False
        recorded = self._recorded_io
        if recorded is not None:
            job_io = recorded.inner
            if getattr(self._strategy, "_checkpoint_io", None) is recorded:
                self._strategy.checkpoint_io = job_io  # the job's own again
        self._strategy = None
        self._recorded_io = None
        if self._applied_hook is not None:
            self._applied_hook.remove()
            self._applied_hook = None
        self._applied = False

    # ------------------------------------------------------------------ Callback hooks

    @guarded()
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not in setup(): the strategy creates the optimizers after the setup hooks have run.
        self._close()
        self._optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._grad_hooks = _GradsReadyHooks(self._optimizer) if self._optimizer is not None else None
        # DeepSpeed's optimizer takes no step hooks and holds the torch one as .optimizer, whose step
        # it calls (until 2026-12-04 the AttributeError left the whole fit without an agent).
        hooked = hookable_optimizer(self._optimizer)
        if hooked is not None:
            self._applied_hook = hooked.register_step_pre_hook(self._note_applied)
        elif self._optimizer is not None:
            warn_once(
                self._said,
                ("lightning", "optimizer unhookable"),
                f"{type(self._optimizer).__name__} takes no step hooks and holds no torch optimizer as .optimizer:"
                " steps are recorded with their gradient norms, but a step whose update was skipped (a loss"
                " scaler's inf/NaN skip) is not told apart",
            )
        self.agent = attach(
            pl_module,
            cast(torch.optim.Optimizer, self._grad_hooks),  # duck-typed: see _GradsReadyHooks
            run=self.run,
            project=self.project,
            collector=self.collector,
            config=self.config,
            registration=self._registration(trainer),
        )
        self._attached = True
        self._last_global_step = trainer.global_step
        self._loss, self._tokens, self._tokens_failed, self._lr = None, None, False, None
        if trainer.global_step > 0:
            # fit(ckpt_path=...) restored the loop state. Step numbers here are 0-based, so the
            # last completed step is global_step - 1 and the next one is global_step.
            loaded = getattr(self.agent, "loaded", None)
            if loaded is not None:
                loaded(step=trainer.global_step - 1, path=trainer.ckpt_path)
            else:
                self.agent.event(
                    "resume",
                    step=trainer.global_step - 1,
                    detail=f"Lightning fit resumed from {trainer.ckpt_path}",
                )
        self._record_checkpoint_writes(trainer)  # last: the steps above hold whatever it meets

    @guarded()
    def _note_applied(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._applied = True

    @guarded()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if optimizer is not self._optimizer or self._grad_hooks is None:
            return
        scale = _unscaled_loss_scale(trainer, optimizer)
        if scale is not None and self.agent is not None:
            self.agent.grads_ready(loss_scale=scale)  # the hook below then does not measure again
        self._grad_hooks.fire()  # gradients are final here; the agent reads them on device
        # The lr scheduler steps before on_train_batch_end, so read the lr this step uses here.
        self._lr = _current_lr(optimizer)

    @guarded()
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._attached or self.agent is None:
            return
        self._check_save_recorded()
        loss = _loss_tensor(outputs)
        if loss is not None:
            loss = loss.detach()
            if pl_module.automatic_optimization and self._loss is not None:
                # Lightning already divided each micro-batch loss by accumulate_grad_batches, so the
                # sum is the step's mean loss. A device add, no sync.
                loss = self._loss + loss
            self._loss = loss
        if self.count_tokens is not None:
            self._count(self.count_tokens, batch)
        # global_step counts optimizer steps: unchanged means this batch only accumulated gradients.
        if trainer.global_step == self._last_global_step:
            return
        self._last_global_step = trainer.global_step
        self.agent.step(
            loss=self._loss,
            tokens=self._tokens,
            lr=self._lr,
            step=trainer.global_step - 1,
            skipped=None if self._applied_hook is None else not self._applied,
        )
        self._applied = False
        self._loss, self._tokens, self._tokens_failed, self._lr = None, None, False, None

    def _count(self, count_tokens: Callable[[Any], int | torch.Tensor], batch: Any) -> None:
        """Add `count_tokens(batch)` to the step's tokens. A tensor stays one (a device add; the agent
        reads it back with the loss: an int() here was a sync per batch). A count_tokens that raises
        leaves this step without tokens and is said once; the step itself is still recorded."""
        try:
            counted = count_tokens(batch)
        except Exception as exc:  # noqa: BLE001 - the user's function, not the job's: never the job's error
            self._tokens_failed, self._tokens = True, None
            warn_once(
                self._said,
                ("lightning", "count_tokens"),
                f"count_tokens(batch) raised {type(exc).__name__}: {str(exc)[:200]}; steps where it raises are"
                " recorded without tokens (and without FLOPs or MFU)",
            )
            return
        if isinstance(counted, torch.Tensor):
            counted = counted.detach()
        if not self._tokens_failed:
            self._tokens = counted if self._tokens is None else self._tokens + counted

    @guarded()
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls this while building the checkpoint dict, before the write: the write
        # itself is recorded by _RecordedCheckpointIO. Global rank 0 writes (DDP): it checks, at
        # the next hook, that the write went through the CheckpointIO.
        self._check_save_recorded()
        if self._attached and self._recorded_io is not None and trainer.is_global_zero:
            self._writes_at_save = self._recorded_io.writes

    @guarded()
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Recorded now; closed later: Lightning runs the checkpoint callbacks' on_exception after this
        # one, and the save of ModelCheckpoint(save_on_exception=True) / OnExceptionCheckpoint is
        # recorded through the CheckpointIO only while the agent is attached (until 2026-12-04 it
        # was closed here, and the crash's checkpoint had no generation).
        if self._attached and self.agent is not None:
            self.agent.event("failure", detail=f"{type(exception).__name__}: {exception}"[:4096])

    @guarded()
    def _teardown_close(self) -> None:
        """The strategy's teardown, after every callback hook of the fit (a failed fit calls no
        callback's teardown, only the strategy's): the crash's save, or save_last's at
        on_train_end, is recorded by then."""
        self._close()

    @guarded()
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()  # idempotent; covers a strategy that did not tear its CheckpointIO down
