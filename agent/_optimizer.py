"""Which optimizer the agent hooks: the one passed to attach(), or the torch optimizer it wraps.

The agent measures gradients and tells applied updates from skipped ones with a step pre-hook,
which only a torch optimizer that ran `Optimizer.__init__` can take. Wrappers that do not:
accelerate's `AcceleratedOptimizer` (what `accelerator.prepare` returns) subclasses Optimizer
without running its __init__, so it has `register_step_pre_hook` but no hook registry, and its
step() calls the optimizer it holds as `.optimizer`; DeepSpeed's ZeRO optimizers and an LR
scheduler are not optimizers at all and hold one as `.optimizer` too.
"""

from __future__ import annotations

from typing import Any

_MAX_WRAPPERS = 4  # accelerate over DeepSpeed over a torch optimizer is three; a cycle must end


def hookable_optimizer(optimizer: Any) -> Any | None:
    """The object whose step pre-hooks run when `optimizer` steps: itself when it has a hook
    registry (a torch optimizer, or a stand-in such as the Lightning callback's), else the first
    optimizer under its `.optimizer` chain that has one; None when there is none."""
    for _ in range(_MAX_WRAPPERS + 1):
        if optimizer is None:
            return None
        if hasattr(optimizer, "_optimizer_step_pre_hooks") and callable(
            getattr(optimizer, "register_step_pre_hook", None)
        ):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def unhookable_notice(optimizer: Any) -> str:
    """The line that tells the user what an optimizer without step hooks, or none, costs, and the fix."""
    what = (
        "attach() got no optimizer"
        if optimizer is None
        else f"the optimizer passed to attach() ({type(optimizer).__name__}) takes no step hooks and holds "
        "no torch optimizer as .optimizer"
    )
    return (
        f"{what}: gradient norms are measured only by agent.clip_grad_norm_() or agent.grads_ready(), "
        "and no step is reported as skipped; pass the torch.optim.Optimizer that steps: "
        "attach(model, optimizer)"
    )
