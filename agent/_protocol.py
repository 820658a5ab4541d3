"""What `attach()` returns: the methods a training script may call, on the agent or its no-op."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from trainvitals.agent._checkpoints import CheckpointHandle, StrPath
from trainvitals.wire.conventions import EventKind


@runtime_checkable
class TrainingAgent(Protocol):
    """The agent's public surface: `Agent` implements it, `NoopAgent` too (doing nothing), so a
    script is written once against this type whether the agent is on or disabled.

    Usage::

        agent: TrainingAgent = trainvitals.agent.attach(model, optimizer, run="gpt-7b-0412")
        with agent:
            for batch in loader:
                ...
                agent.step(loss=loss, tokens=batch.numel())
    """

    @property
    def hooks(self) -> int:
        """Hooks installed and not yet removed (0 after close, always 0 for the no-op)."""
        ...

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        tokens: int | torch.Tensor | None = None,
        flops: float | torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
        grad_norm: torch.Tensor | float | None = None,
        step: int | None = None,
        skipped: bool | None = None,
    ) -> None: ...

    def event(
        self,
        kind: EventKind,
        *,
        detail: str | None = None,
        step: int | None = None,
        domains: dict[str, str] | None = None,
    ) -> None: ...

    def grads_ready(self, *, loss_scale: torch.Tensor | None = None) -> None: ...

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor: ...

    def checkpoint(
        self, *, step: int | None = None, path: StrPath | None = None, generation: int | None = None
    ) -> AbstractContextManager[CheckpointHandle]: ...

    def save(self, obj: Any, path: StrPath, *, step: int | None = None, **kwargs: Any) -> None: ...

    def dcp_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: StrPath, step: int | None = None, **kwargs: Any
    ) -> Any: ...

    def dcp_async_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: StrPath, step: int | None = None, **kwargs: Any
    ) -> Any: ...

    def checkpoint_saved(
        self,
        *,
        step: int | None = None,
        path: StrPath | None = None,
        generation: int | None = None,
        stall_seconds: float | None = None,
    ) -> None: ...

    def loaded(self, *, step: int, path: StrPath | None = None, generation: int | None = None) -> None: ...

    def flush(self, timeout: float = 10.0) -> bool: ...

    def close(self, timeout: float | None = None) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def __enter__(self) -> TrainingAgent: ...

    def __exit__(self, *exc: object) -> None: ...
