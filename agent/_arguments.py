"""What attach() was given: the mistakes it sees most, each refused in one line that names the fix.

attach() never raises: a refused argument disables the agent with one ERROR line, so that line
has to say what to change. Before, a module passed as `model.parameters()` read "'generator'
object has no attribute 'named_parameters'", and a run id with a space a five-line pydantic error.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic
from torch import nn

from trainvitals.wire.v1 import _RUN_ID_PATTERN as RUN_ID_PATTERN  # the one definition of a run id
from trainvitals.wire.v1 import RUN_ID_CHARS, RUN_ID_MAX_LENGTH


class AttachError(ValueError):
    """A mistake in attach()'s arguments; the text names it and its fix."""


def check_arguments(model: Any, optimizer: Any) -> None:
    """The model must be a module and the optimizer not one (a swapped pair is said as such)."""
    if model is not None and not isinstance(model, nn.Module):
        if isinstance(optimizer, nn.Module):
            raise AttachError(
                f"attach() got a {type(model).__name__} first and the module second: "
                "call attach(model, optimizer)"
            )
        raise AttachError(
            f"attach() takes the model (a torch.nn.Module) first, got a {type(model).__name__}: "
            "pass the module itself, not model.parameters()"
        )
    if isinstance(optimizer, nn.Module):
        raise AttachError(
            f"attach() takes the optimizer second, got the module {type(optimizer).__name__}: "
            "call attach(model, optimizer)"
        )


_TOKEN = re.compile(r"[!-~]+")  # printable ASCII without spaces: what an HTTP header value carries


def check_token(token: str | None) -> None:
    """A token an HTTP header can carry (AgentConfig has stripped its ends); never printed."""
    if token is not None and not _TOKEN.fullmatch(token):
        raise AttachError(
            "the collector token (TRAINVITALS_TOKEN or AgentConfig.token) holds a space or a control "
            "character: pass the token exactly as `trainvitals token create` printed it"
        )


def check_run_id(run: str, source: str) -> None:
    """A run id the collector takes: 1-128 letters, digits and . _ : -."""
    if isinstance(run, str) and 0 < len(run) <= RUN_ID_MAX_LENGTH and re.fullmatch(RUN_ID_PATTERN, run):
        return
    suggestion = re.sub(f"[^{RUN_ID_CHARS}]+", "-", str(run)).strip("-")[:RUN_ID_MAX_LENGTH] or "my-run"
    raise AttachError(
        f"run id {run!r} (from {source}) may hold only letters, digits and . _ : -, at most "
        f"{RUN_ID_MAX_LENGTH} characters: use e.g. {suggestion!r}"
    )


def one_line(exc: pydantic.ValidationError, what: str) -> str:
    """A registration the wire model refused, as one line: each field, its problem, its value."""
    problems = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or what
        got = repr(err.get("input"))
        problems.append(f"{field}: {err['msg']} (got {got if len(got) <= 80 else got[:77] + '...'})")
    return f"{what} refused: " + "; ".join(problems)
