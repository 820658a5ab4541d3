"""Agent configuration: one dataclass, every field documented, environment overrides in one place."""

from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainvitals.wire.conventions import auto_send_interval_s

DISABLE_ENV = "TRAINVITALS_DISABLE"



def default_spill_dir() -> str:
    """`<tmp>/trainvitals-spool-<user>`: node-local (tempfile's TMPDIR, else /tmp) and per user.

    Not the working directory: on a cluster that is usually a shared file system, where every
    rank's spool writes would become metadata traffic for everyone. A spool is delivered by the
    next process of the same rank on the same node, or by `trainvitals replay` on the file.
    """
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container without a passwd entry)
        user = str(os.getuid())
    return os.path.join(tempfile.gettempdir(), f"trainvitals-spool-{user}")


def disabled_by_env() -> bool:
    """TRAINVITALS_DISABLE=1 (or true/yes) turns the agent into a no-op before it touches anything."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """How the agent samples, batches and delivers.

    Usage::

        cfg = AgentConfig(collector="http://collector:8000", send_interval_s=5.0)
        agent = attach(model, optimizer, run="llama-7b-0412", config=cfg)
    """

    collector: str | None = None
    """Collector base URL. None: $TRAINVITALS_COLLECTOR, else http://127.0.0.1:8000. "" sends nothing."""
    token: str | None = None
    """Bearer token for the collector (scope: ingest). None: $TRAINVITALS_TOKEN."""
    project: str | None = None
    """The run's project. None: $TRAINVITALS_PROJECT, else none named: the collector registers the
    run under the token's project (with auth off, 'default'). A project the token is not for is
    refused (403), never stored elsewhere."""
    send_interval_s: float | None = None
    """How often the background thread ships a batch. None: automatic, by the job's size
    (send_interval_for): 2 s up to 1,024 ranks, world_size / 512 s above (32 s at 16,384 ranks),
    so a whole job sends at most about 512 batches/s however large it grows."""
    max_batch_records: int = 20_000
    """Records per HTTP request at most; a backlog goes out as several batches."""
    queue_max_records: int = 200_000
    """In-memory bound; when full the oldest record is dropped and counted (never blocks training)."""
    http_timeout_s: float = 5.0
    """Per request; a hung collector costs the background thread at most this per attempt."""
    retry_backoff_s: float = 2.0
    """After a failed delivery, wait at least this long before trying the collector again."""
    auth_retry_s: float = 300.0
    """How long the collector's authentication refusals (401, 403) are retried (every 10 s, or every
    send interval when that is longer) before the refused batches are set aside in the quarantine
    file: time for an operator to create or fix a token while the job runs, short enough that a
    wrong one does not hold data back for long."""
    spill_dir: str | None = None
    """Where batches wait on disk when they cannot be delivered now (and every batch of a process
    that is exiting, until delivered). None: $TRAINVITALS_SPILL_DIR, else the node-local
    `<tmp>/trainvitals-spool-<user>` (default_spill_dir())."""
    spill_max_bytes: int = 512 * 1024 * 1024
    """Per rank; past it new batches are dropped and counted rather than filling the disk."""
    record_file: str | None = None
    """Also append every batch (JSONL, wire format) to this file; '{rank}' is replaced."""
    flush_timeout_s: float = 10.0
    """close()/exit waits at most this long for delivery; the rest stays spooled for later."""
    exit_on_sigterm: bool = True
    """Turn SIGTERM (torchrun stops every rank with it when one fails) into an orderly exit so the
    exit pass spools and delivers the last records; only when the job left SIGTERM at its default
    (agent/_sigterm.py). False: SIGTERM ends the process at once and what was queued is lost."""
    grad_groups: str = "block"
    """Gradient-norm groups: 'block' (per numbered layer, e.g. layers.3), 'param' or 'none'."""
    grad_ownership: str = "auto"
    """Who counts a gradient once: 'auto' (DTensor placements, DDP, FSDP), 'replicated', 'sharded'."""
    fp8: str = "auto"
    """FP8 numerics: 'auto' (recipe state where a real FP8 recipe runs, shadow headroom on other
    Linear-like modules), 'recipe' (only real FP8 modules), 'shadow' (only hooks), 'off'."""
    fp8_every_steps: int = 20
    """Shadow mode (bf16/fp32 modules): the cheap tier (amax, headroom, lag, staleness) every N
    steps; on the others the monitor's hooks are not even registered. Modules that train through an FP8 recipe are read
    from the recipe every step regardless (the recipe has computed the amax: reading it is two
    small copies per module). Not 1 by default for shadow modules: an exact amax is one extra read
    of every monitored input, weight and grad_output (fp8.md tier 1), ~2.6% of a step on the
    example model on this CPU (4.3 ms of 161 ms) and ~2% of a large GEMM on an H100; every 20th
    step keeps the whole agent inside the 0.5% budget there (docs/performance-agent.md). The
    shadow history then keeps L / N samples spanning the recipe's L steps. 1: every step. The
    agent may widen it to 2N or 4N once, early in the run: see fp8_cost_budget."""
    fp8_cost_budget: float = 0.0025
    """The share of the step time the shadow samples may take, amortised. After 5 samples at
    fp8_every_steps, the agent compares a sample's cost with the median step; over budget, it
    samples every 2x or 4x fp8_every_steps for the rest of the run, and says so once. A host with
    slow memory pays 3x a fast one's for the same reads (docs/performance-agent.md); on a GPU the
    reads run on the device and the cadence stays. 0: always fp8_every_steps."""
    fp8_expensive_every_steps: int = 200
    """Expensive tier (saturation, underflow, crest, non-finite) every N steps; 0 disables it.
    Several more reads of every monitored tensor (such a step costs the example model 11 ms on this
    CPU, cheap tier included, where a step is 130-160 ms): every 200th step is ~0.04% of the step
    time amortised. These are slow-moving statistics; clipping itself is seen every step through
    headroom (docs/performance-agent.md)."""
    fp8_ranks: str = "dp0"
    """'dp0': only data-parallel replica 0 monitors tensors (it covers every shard once); 'all'."""
    fp8_module_filter: Callable[[str, Any], bool] | None = None
    """(fqn, module) -> monitor it? Default: nn.Linear except the output head."""
    time_collectives: bool = True
    """Split collective wait from compute by wrapping DDP's all-reduce in a comm hook (only when
    the DDP model has no comm hook of its own)."""
    checksum: str = "sha256"
    """Checkpoint content checksum, computed on a background thread: 'sha256' or 'none'."""
    log_every_s: float = 60.0
    """Rate limit for the agent's own warnings."""
    tags: dict[str, str] = field(default_factory=dict)
    """Free-form run tags sent with the registration."""

    def __post_init__(self) -> None:
        # The checks below raise only for values the job's code passes (a typo a first run shows);
        # what comes from the environment or a file is taken as it is, and attach() refuses what
        # cannot work with one line (agent/_arguments.py): a bad secret must not crash the job.
        if self.send_interval_s is not None and self.send_interval_s <= 0:
            raise ValueError("send_interval_s must be > 0 (or None: automatic)")
        if self.max_batch_records < 1 or self.queue_max_records < self.max_batch_records:
            raise ValueError("need 1 <= max_batch_records <= queue_max_records")
        if self.grad_groups not in ("block", "param", "none"):
            raise ValueError("grad_groups must be 'block', 'param' or 'none'")
        if self.fp8 not in ("auto", "recipe", "shadow", "off"):
            raise ValueError("fp8 must be 'auto', 'recipe', 'shadow' or 'off'")
        if self.fp8_ranks not in ("dp0", "all"):
            raise ValueError("fp8_ranks must be 'dp0' or 'all'")
        if self.fp8_every_steps < 1 or self.fp8_expensive_every_steps < 0:
            raise ValueError("fp8_every_steps must be >= 1 and fp8_expensive_every_steps >= 0")
        if not 0 <= self.fp8_cost_budget < 1:
            raise ValueError("fp8_cost_budget must be a share of the step time in [0, 1): 0.0025 is 0.25%")
        if self.checksum not in ("sha256", "none"):
            raise ValueError("checksum must be 'sha256' or 'none'")
        if self.grad_ownership not in ("auto", "replicated", "sharded"):
            raise ValueError("grad_ownership must be 'auto', 'replicated' or 'sharded'")
        if self.collector is None:
            self.collector = os.environ.get("TRAINVITALS_COLLECTOR", "http://127.0.0.1:8000")
        self.collector = self.collector.strip()
        if self.token is None:
            self.token = os.environ.get("TRAINVITALS_TOKEN") or None
        if self.token is not None:
            # A token read from a file or a Kubernetes secret usually ends in a newline, which no
            # HTTP header may hold: every delivery failed, with the token itself in the error line.
            # A space or control character inside it is refused by attach() (check_token), not here:
            # a job builds its config before attach(), and the environment's content must not raise
            # there (not even with TRAINVITALS_DISABLE=1).
            self.token = self.token.strip() or None
        if self.project is None:
            self.project = os.environ.get("TRAINVITALS_PROJECT") or None
        if self.auth_retry_s < 0:
            raise ValueError("auth_retry_s must be >= 0")
        if self.spill_dir is None:
            self.spill_dir = os.environ.get("TRAINVITALS_SPILL_DIR") or default_spill_dir()

    def send_interval_for(self, world_size: int) -> float:
        """The send interval of one rank of a job of `world_size` ranks: send_interval_s when set,
        else auto_send_interval_s(world_size)."""
        return self.send_interval_s if self.send_interval_s is not None else auto_send_interval_s(world_size)


def send_phase(rank: int) -> float:
    """Where in the send interval this rank's passes fall, a fraction in [0, 1): the ranks of a job
    spread evenly over the interval (the golden ratio's low-discrepancy sequence: any n consecutive
    ranks split it into gaps of at most three sizes). The ranks of a job attach within a second or
    so of each other; with one phase for all, a 16,384-rank job's requests would reach the
    collector as one burst every 32 s instead of 512 a second."""
    return (rank * 0.6180339887498949) % 1.0
