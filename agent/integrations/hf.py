"""Hugging Face `transformers` Trainer integration: one callback, no changes to the training script.

Importing this module imports transformers; `trainvitals.agent` itself never does.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import transformers
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainvitals.agent._agent import attach
from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget, guarded
from trainvitals.agent._optimizer import hookable_optimizer
from trainvitals.agent._protocol import TrainingAgent

if TYPE_CHECKING:
    from transformers import Trainer


def _current_lr(optimizer: torch.optim.Optimizer | None) -> float | None:
    if optimizer is None or not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        # A tensor lr on an accelerator would need a sync to read; skip it rather than stall the step.
        return float(lr) if lr.device.type == "cpu" else None
    return float(lr) if lr is not None else None


def _calling_trainer() -> Trainer | None:
    """The Trainer whose callback handler is calling this callback, found on the call stack (a few
    frames up: Trainer, CallbackHandler.call_event, the guard): HF passes callbacks no trainer."""
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, transformers.Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame reference would keep every local of the stack alive


def _accepts(fn: Any, *names: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


def _merge(auto: dict[str, Any], user: dict[str, Any] | None) -> dict[str, Any]:
    """User registration wins; nested sections (model, parallelism, tags ...) merge one level deep."""
    out = dict(auto)
    for key, value in (user or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _auto_registration(args: TrainingArguments) -> dict[str, Any]:
    """What the Trainer already knows: the batch layout. The model's dims (its HF config) and
    parameter counts attach() derives itself (agent/_model_facts.py)."""
    reg: dict[str, Any] = {
        "tags": {"framework": "transformers", "framework_version": transformers.__version__},
        "parallelism": {
            "micro_batch": args.per_device_train_batch_size,
            "global_batch": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * max(args.world_size, 1),
        },
    }
    return reg


class TrainvitalsCallback(TrainerCallback):
    """Attaches the trainvitals agent to a `transformers.Trainer` run.

    Usage::

        from trainvitals.agent.integrations.hf import TrainvitalsCallback

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[TrainvitalsCallback(run="gpt2-ft-0412")])
        trainer.train()

    What it records, per optimizer step (step number = `state.global_step`, as in HF's own logs):
    lr (the one this step used), tokens (when `include_num_input_tokens_seen` is on; HF counts them
    over all ranks, so the per-rank figure is that count / world size), loss and grad_norm.

    Loss: every step's, at any logging interval: the per-step difference of the trainer's
    on-device loss accumulator (a tensor, no sync; the agent copies it asynchronously). HF hands
    callbacks the model and optimizer but not the trainer, so the callback finds the Trainer whose
    handler calls its on_train_begin (`trainer=` names it outright). Without a trainer it falls
    back to HF's logs, whose loss is the mean over the logging window: the step's loss only when
    the window is one step (`logging_steps=1`); at HF's default of 500 no step had a loss before
    2026-11-29. Both paths see what HF sees, including its `logging_nan_inf_filter` (on by
    default), which replaces non-finite losses before logging.

    Also: a `resume` event when training starts from a checkpoint, a checkpoint generation per
    `checkpoint-N` directory the Trainer saves (its stall: from the Trainer's last callback before
    the save, an evaluation excluded, to on_save; recorded deleted once `save_total_limit` removes
    it), and close() (flush, hooks removed) at the end of training.
    """

    def __init__(
        self,
        *,
        run: str | None = None,
        project: str | None = None,
        collector: str | None = None,
        config: AgentConfig | None = None,
        registration: dict[str, Any] | None = None,
        trainer: Trainer | None = None,
    ) -> None:
        self.run = run
        self.project = project
        self.collector = collector
        self.config = config
        self.registration = registration
        self.agent: TrainingAgent | None = None
        """The agent of the current (or last) train() call; kept after close for stats()."""
        self._bound = trainer
        self._trainer = trainer  # the bound one, else the one found at on_train_begin
        self._errors = ErrorBudget()
        self._attached = False
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: dict[str, Any] | None = None
        self._lr: float | None = None
        self._tokens_seen = 0
        self._last_logged_step = 0
        self._loss_mark: torch.Tensor | None = None
        # When the Trainer's last callback before a save ended (on_step_end, on_log, on_evaluate):
        # on_save comes right after the save, so the difference is the save's stall.
        self._before_save: float | None = None

    # ------------------------------------------------------------------ attach / close

    def _attach(self, args: TrainingArguments, state: TrainerState, optimizer: Any) -> None:
        inner = hookable_optimizer(optimizer)  # the torch optimizer under accelerate's wrapper
        if inner is None:
            return  # created lazily by this Trainer setup: retried at the next on_step_begin
        self._optimizer = inner
        self.agent = attach(
            self._model,
            inner,
            run=self.run,
            project=self.project,
            collector=self.collector,
            config=self.config,
            registration=_merge(_auto_registration(args), self.registration),
        )
        self._attached = True
        if state.global_step > 0:
            # The Trainer restored its state from a checkpoint. Prefer the agent's own resume API
            # when this agent version has it (same `resume` event, and it knows the step counter).
            loaded = getattr(self.agent, "loaded", None)
            if loaded is not None and _accepts(loaded, "step"):
                loaded(step=state.global_step)
            else:
                self.agent.event(
                    "resume",
                    step=state.global_step,
                    detail=f"transformers Trainer resumed from a checkpoint at step {state.global_step}",
                )

    def _close(self) -> None:
        if self._attached and self.agent is not None:
            self._emit()
            self.agent.close()
        self._attached = False

    # ------------------------------------------------------------------ step records

    def _emit(self) -> None:
        """Hand the pending step to the agent (called before anything that would reorder it)."""
        pending, self._pending = self._pending, None
        if pending is not None and self._attached and self.agent is not None:
            self.agent.step(**pending)

    def _tracked_loss(self) -> torch.Tensor | None:
        # The Trainer sums each step's loss into one device tensor and zeroes it in place when it
        # logs; the difference since our last snapshot is this step's loss. Two scalar device ops,
        # no sync. `_tr_loss` is private to the Trainer (transformers >= 5): absent means unsupported.
        tracked = getattr(self._trainer, "_tr_loss", None)
        if not isinstance(tracked, torch.Tensor):
            return None
        now = tracked.detach().clone()  # a copy: the accumulator keeps changing in place
        loss = now if self._loss_mark is None else now - self._loss_mark
        self._loss_mark = now
        return loss

    # ------------------------------------------------------------------ TrainerCallback hooks

    @guarded()
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # A second train() on the same Trainer (auto_find_batch_size retries, a new fit) builds a
        # new optimizer: close the old agent so its hook goes away, then attach afresh.
        self._close()
        self._trainer = self._bound or _calling_trainer()
        self._pending = None
        self._model = kwargs.get("model")
        self._tokens_seen = state.num_input_tokens_seen
        self._last_logged_step = state.global_step
        self._loss_mark = None
        self._attach(args, state, kwargs.get("optimizer"))

    @guarded()
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._emit()
        if not self._attached:
            self._attach(args, state, kwargs.get("optimizer"))
        # The scheduler stepped at the end of the previous step, so this is the lr this step uses
        # (the value HF logs as learning_rate for it).
        self._lr = _current_lr(self._optimizer)

    @guarded()
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._attached:
            return
        pending: dict[str, Any] = {"step": state.global_step, "lr": self._lr}
        seen = state.num_input_tokens_seen
        if seen > self._tokens_seen:  # stays 0 unless include_num_input_tokens_seen is on
            pending["tokens"] = round((seen - self._tokens_seen) / max(args.world_size, 1))
        self._tokens_seen = seen
        loss = self._tracked_loss()
        if loss is not None:
            pending["loss"] = loss
        self._pending = pending
        # DefaultFlowCallback ran before us and decided whether HF logs this step; if it does, the
        # log (loss, grad_norm) follows right away in on_log, before any eval or save.
        if not control.should_log:
            self._emit()
        self._before_save = time.perf_counter()

    @guarded()
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        logs = logs or {}
        pending = self._pending
        if pending is not None and pending["step"] == state.global_step and "loss" in logs:
            if "loss" not in pending and state.global_step - self._last_logged_step == 1:
                pending["loss"] = logs["loss"]  # a one-step window: the mean is this step's loss
            if logs.get("grad_norm") is not None:
                pending["grad_norm"] = logs["grad_norm"]
        if "loss" in logs:
            # HF zeroed its loss accumulator for this log: our snapshot restarts from zero too.
            self._last_logged_step = state.global_step
            self._loss_mark = None
        self._emit()
        self._before_save = time.perf_counter()

    @guarded()
    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_save = time.perf_counter()  # an evaluation before the save is not its stall

    @guarded()
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._emit()  # the step record goes first, then the save that followed it
        if not self._attached or self.agent is None:
            return
        path = os.path.join(args.output_dir or ".", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        stall = None if self._before_save is None else time.perf_counter() - self._before_save
        self._before_save = None
        record = getattr(self.agent, "checkpoint_saved", None)
        if record is not None and _accepts(record, "path", "step", "stall_seconds"):
            # The stall lets the cadence advisor weigh this run's saves (until 2026-11-29 it had none).
            record(path=path, step=state.global_step, stall_seconds=stall)
        elif record is not None and _accepts(record, "path", "step"):
            record(path=path, step=state.global_step)
        else:
            self.agent.event("note", step=state.global_step, detail=f"checkpoint saved: {path}")

    @guarded()
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close()
