"""Step-time overhead and memory of the trainvitals agent on the example GPT (single process, CPU).

    python benchmarks/agent_overhead.py                        # defaults below, ~10 minutes
    python benchmarks/agent_overhead.py --rounds 10 --long-steps 300   # quick look

What is compared. One model, one optimizer, one data stream, `torch.set_num_threads(1)`. The
training step is the example's (`trainvitals.examples.train_gpt`): forward, cross-entropy,
backward, `clip_grad_norm_` (with an agent: `agent.clip_grad_norm_`, torch's clipping that also
yields the agent's group norms), AdamW step, `zero_grad`, and with an agent `agent.step(loss=...,
grad_norm=..., tokens=..., flops=...)`. Each round runs one block of `--block-steps` timed steps
per condition, in a freshly shuffled order: the baseline (no agent at all), a second baseline
(A/A control: the spread it shows is the noise floor of this machine), and one block per agent
configuration. Before an agent block the agent is attached, after it the agent is closed, both
outside the timed window; every block starts with `--block-warmup` untimed steps (the first
step after attach has no FP8 history yet and builds caches).

Why this pairing is fair. Hooks change the model until close(), so either the agent comes and
goes per block or two model copies are needed. Two copies would sit at different addresses and
train on different weights, and a long-lived agent's exporter thread would do its work during
the baseline blocks too, hiding part of its cost. With attach/close per block on a single
model, both conditions run the same tensors, allocator state and weights trajectory, and the
exporter thread exists only during agent blocks; blocks are long enough (by default at least
two send intervals) that its periodic wake-ups fall inside the timed window in proportion.
What it ships at close() (the tail of the block) is not timed, which is why the exporter
thread's own CPU time per step is reported separately from a long continuous run.

Statistics. Per round, ratio = (step time of the agent block) / (step time of the baseline
block), from block means (every cost, periodic ones such as exporter wake-ups and GC included)
and from block medians (the every-step hot path, robust to other processes stealing the CPU for
a while). Reported: the median ratio over rounds with a 95% bootstrap interval (resampling
rounds), for wall time and for the training thread's CPU time. On a shared machine the A/A line
shows how far apart two identical conditions land; a 0.5% effect is only resolvable when it is
tight. So the agent's direct cost is also measured by accounting: the time spent inside the
agent's own training-thread entry points (`agent.step`, the optimizer pre-step hook, every FP8
module and tensor hook), divided by the baseline step time of the same round. That misses only
the indirect costs (hook dispatch in `nn.Module.__call__`, cache effects, GIL hand-offs to the
exporter thread), but its noise scales with the small quantity measured, not with the step. The
memory section runs `--long-steps` steps with the default agent attached and reports RSS
every 10% of the run, plain and after glibc's `malloc_trim` (the live heap; growth must flatten:
the queue, spool and histories are bounded), the
exporter thread's CPU seconds per step, the tracemalloc peak of Python allocations during
measured steps with and without the agent, and the Python memory blocks one agent.step()
leaves alive until the exporter ships them (independent of the number of monitored tensors).
It also reports the direct cost amortised over the whole run against a baseline run of the same
length (every periodic FP8 tier counted), in wall time and in the training thread's CPU time
(which leaves out preemption by other processes: on a shared machine the wall figure can double);
clipping through the agent counts as what it costs beyond torch's clip, measured over
`--clip-pairs` pairs of adjacent steps (the agent's clip in one, torch's in the next),
and the entry points' cost per step by kind: ordinary, shadow-sampled (every fp8_every_steps)
and expensive-tier steps.

The peers section (`--peer-steps N`, default 200; 0 skips it) measures, in the same run and on the
same model, what a user would otherwise attach: a hand-written logger writing one JSON line per
step (loss, grad norm, lr, step time; `.item()` on the loss and norm), TensorBoard scalars
(`torch.utils.tensorboard.SummaryWriter.add_scalar`, the same four) and `wandb.watch(model,
log="gradients")` in offline mode with `log_freq` 1 and 100 (a gradient histogram of every
parameter every log_freq steps, plus `wandb.log` of the same scalars every step). Each peer runs
one block of N steps between two baseline blocks of N steps; its cost is the training thread's
CPU time per step against the mean of the two baselines (and the time inside its own calls, for
the loggers whose whole cost is there). wandb and tensorboard come with the `bench` extra
(`pip install -e '.[bench]'`); a peer whose package is missing is reported as such.

The spool study (`--spool-batches N`, off by default) compares the exporter's two ways of using
its on-disk spool on the same agent, batch by batch: every batch written ahead (appended, fsynced,
sent from the file, the file removed) against batches sent from memory with the spool written only
when delivery fails (the agent's default). It reports the exporter's CPU and wall time per batch,
fsync calls and time, bytes written to disk, and the time each batch spends in its HTTP request
(docs/agent.md, "Delivery and the spool").
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from bench_results import add_json_arg, cpu_description, write_results
from bench_results import machine as machine_info

import trainvitals.agent as tv
from trainvitals.examples.train_gpt import GPT, flops_per_token, model_dims, synthetic_batch

# A collector stand-in that acknowledges everything: the agent runs its real delivery path
# (JSON, HTTP keep-alive) without a database competing for the CPU.
_SINK = r"""
import http.server
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    # Fixed cadences: fp8_cost_budget=0, or the agent would widen them where a sample is dear.
    "full": {"fp8_every_steps": 1, "fp8_expensive_every_steps": 1, "fp8_cost_budget": 0},
    "cheap-every-step": {"fp8_every_steps": 1, "fp8_cost_budget": 0},
    "fp8-off": {"fp8": "off"},
}
"""Agent configurations by name: AgentConfig overrides on top of the defaults. --configs also
takes ad-hoc ones spelled as overrides, e.g. `fp8_every_steps=4+fp8_expensive_every_steps=0`."""


def config_overrides(name: str) -> dict[str, Any]:
    if name in CONFIGS:
        return CONFIGS[name]
    if "=" not in name:
        raise SystemExit(f"unknown config {name!r}; choose from {list(CONFIGS)} or spell key=value+...")
    out: dict[str, Any] = {}
    for pair in name.split("+"):
        key, _, value = pair.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    tv.AgentConfig(collector="", **out)  # fail now on a bad key or value, not in round 1
    return out


@dataclass(slots=True)
class Job:
    """The example's model, optimizer and data stream, and the agent currently attached (if any)."""

    args: argparse.Namespace
    model: GPT
    optimizer: torch.optim.Optimizer
    gen: torch.Generator
    dims: dict[str, int]
    flops: float
    agent: Any = None
    peer: Any = None  # a Peer logging this step, or None
    step: int = 0
    torch_clip: bool = False  # clip with torch's own function even with an agent (paired_clip_delta)


@dataclass(slots=True)
class Block:
    """Timings of one timed block, per step: means (everything, periodic costs included) and
    medians (the every-step hot path, robust to other processes taking the CPU now and then)."""

    wall: float
    cpu: float
    wall_median: float
    cpu_median: float
    agent_direct: float = 0.0
    exporter_cpu: float | None = None
    clip: float = 0.0


@dataclass(slots=True)
class Results:
    """Per-condition block timings, one entry per round."""

    blocks: dict[str, list[Block]] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--configs", default="default,full,fp8-off", help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=30, help="paired rounds (one block per condition each)")
    p.add_argument("--block-steps", type=int, default=0, help="timed steps per block; 0: >= 2 send intervals")
    p.add_argument("--block-warmup", type=int, default=3, help="untimed steps at the start of every block")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before the first round")
    # A single process: the agent's automatic interval for a world of 1 (2 s).
    p.add_argument("--send-interval", type=float, default=tv.AgentConfig(collector="").send_interval_for(1))
    p.add_argument(
        "--collector",
        choices=("sink", "unreachable", "off"),
        default="sink",
        help="sink: a local process acknowledging every request; unreachable: a closed port "
        "(everything goes to the spool); off: collector='' (spool only, nothing sent)",
    )
    p.add_argument("--long-steps", type=int, default=1500, help="steps of the memory run (0: skip)")
    p.add_argument(
        "--clip-pairs",
        type=int,
        default=100,
        help="pairs of adjacent steps after the memory run's agent steps, clipped through the agent and "
        "by torch in turn: what clipping through the agent costs beyond torch's (0: use the two runs' means)",
    )
    p.add_argument(
        "--spool-batches",
        type=int,
        default=0,
        help="batches per design in the spool study (0: skip): every batch written ahead to the spool "
        "(with fsync) against batches sent from memory, the spool used only when delivery fails",
    )
    p.add_argument(
        "--peer-steps",
        type=int,
        default=200,
        help="steps per peer block (0: skip): a JSON-line logger, TensorBoard scalars, wandb.watch offline",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fp8",
        action="store_true",
        help="train through the emulated FP8 delayed-scaling Linear (as the example's --fp8): the agent "
        "reads the recipe every step instead of shadow-hooking on sampled steps",
    )
    add_json_arg(p)
    return p.parse_args(argv)


def make_job(args: argparse.Namespace) -> Job:
    torch.manual_seed(args.seed)
    model = GPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, seq=args.seq)
    if args.fp8:
        from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

        convert_linears(model.layers, DelayedScalingRecipe(history_len=16))
    dims = model_dims(args, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(args.seed)
    return Job(args, model, optimizer, gen, dims, args.batch * args.seq * flops_per_token(dims))


def train_step(job: Job) -> None:
    """The example's training step (train_gpt.main), minus fault injection and checkpoints."""
    args = job.args
    x, y = synthetic_batch(job.gen, args)
    loss = F.cross_entropy(job.model(x).reshape(-1, args.vocab), y.reshape(-1))
    loss.backward()
    # As the example: clipping through the agent when there is one (torch's clip_grad_norm_ whose
    # per-parameter norms also give the agent its group norms). Timed in both conditions: the
    # agent's part of it is the difference (clip_seconds, used by the direct accounting).
    c0, t0 = time.thread_time(), time.perf_counter()
    if job.agent is not None and not job.torch_clip:
        total_norm = job.agent.clip_grad_norm_(job.model.parameters(), 1.0)
    else:
        total_norm = torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1.0)
    _CLIP_SECONDS[0] += time.perf_counter() - t0
    _CLIP_CPU[0] += time.thread_time() - c0
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    if job.peer is not None:
        c0 = time.thread_time()
        job.peer.after_step(job.step, loss, total_norm)
        _PEER_CPU[0] += time.thread_time() - c0
    if job.agent is not None:
        # step= as the example passes it: sampled steps (every fp8_every_steps-th) follow the job's
        # step counter across blocks, so a block samples its fair share however it is aligned.
        c0, t0 = time.thread_time(), time.perf_counter()
        job.agent.step(
            loss=loss, grad_norm=total_norm, tokens=args.batch * args.seq, flops=job.flops, step=job.step
        )
        _AGENT_SECONDS[0] += time.perf_counter() - t0
        _AGENT_CPU[0] += time.thread_time() - c0
    job.step += 1


def attach(job: Job, overrides: dict[str, Any], collector: str, spill_dir: str, send_interval: float) -> None:
    config = tv.AgentConfig(
        collector=collector, spill_dir=spill_dir, send_interval_s=send_interval, **overrides
    )
    job.agent = tv.attach(
        job.model,
        job.optimizer,
        run="agent-overhead",
        config=config,
        registration={
            "model": job.dims,
            "parallelism": {"world_size": 1, "dp": 1, "micro_batch": job.args.batch},
            "hardware": {"gpu_type": "cpu", "gpu_count": 1, "peak_flops": 5e10},
            "fp8": {"enabled": job.args.fp8, "history_len": 16 if job.args.fp8 else 1024},
        },
    )
    assert isinstance(job.agent, tv.Agent), "attach() returned a no-op agent (TRAINVITALS_DISABLE?)"


_AGENT_SECONDS = [0.0]  # time spent inside agent entry points on the training thread
_CLIP_SECONDS = [0.0]  # time spent clipping (torch's, or the agent's which includes torch's work)
# The same in the training thread's CPU time: wall time counts the thread's preemption by other
# processes as agent time, CPU time does not (on a shared machine the two part).
_AGENT_CPU = [0.0]
_CLIP_CPU = [0.0]
_AGENT_COST: list[Any] = []  # the memory run's Cost of the default agent, for the comparison table
_HEADLINE: dict[str, Any] = {}  # the memory run's amortised cost and step kinds, for --json
_PEER_CPU = [0.0]  # training-thread CPU time inside a peer's per-step call
_STEP_SECONDS = [0.0]  # one training step without the agent, measured before the rounds


def instrument_agent() -> None:
    """Accumulate the time spent inside the agent's training-thread entry points.

    Wraps, before any agent is built, the FP8 monitor's hook guard (every module and tensor hook
    goes through it) and the optimizer pre-step hook; agent.step() is timed in train_step().
    Costs two perf_counter() and two thread_time() calls per hook call, a few microseconds per
    sampled step (the hooks exist only on those).
    """
    from trainvitals.agent import _agent, _fp8_monitor

    guard = _fp8_monitor.Fp8Monitor._guard

    def timed_guard(self: Any, fn: Any) -> Any:
        inner = guard(self, fn)

        def timed(*args: Any) -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                inner(*args)
            finally:
                _AGENT_SECONDS[0] += time.perf_counter() - t0
                _AGENT_CPU[0] += time.thread_time() - c0

        return timed

    before = _agent.Agent._before_optimizer_step

    def timed_before(self: Any, *args: Any) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            before(self, *args)
        finally:
            _AGENT_SECONDS[0] += time.perf_counter() - t0
            _AGENT_CPU[0] += time.thread_time() - c0

    _fp8_monitor.Fp8Monitor._guard = timed_guard
    _agent.Agent._before_optimizer_step = timed_before


def detach(job: Job) -> None:
    job.agent.close()
    job.agent = None


def exporter_cpu_seconds(agent: Any) -> float | None:
    """CPU seconds used so far by the agent's exporter thread (its own clock, not wall time)."""
    thread: threading.Thread | None = agent._exporter._thread
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):
        return None


def timed_block(job: Job, steps: int) -> Block:
    exp0 = exporter_cpu_seconds(job.agent) if job.agent is not None else None
    walls: list[float] = []
    cpus: list[float] = []
    direct0 = _AGENT_SECONDS[0]
    clip0 = _CLIP_SECONDS[0]
    for _ in range(steps):
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        train_step(job)
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.thread_time() - cpu0)
    exp1 = exporter_cpu_seconds(job.agent) if job.agent is not None else None
    exporter = (exp1 - exp0) / steps if exp0 is not None and exp1 is not None else None
    return Block(
        statistics.fmean(walls),
        statistics.fmean(cpus),
        statistics.median(walls),
        statistics.median(cpus),
        (_AGENT_SECONDS[0] - direct0) / steps,
        exporter,
        (_CLIP_SECONDS[0] - clip0) / steps,
    )


def bootstrap_median_ci(values: list[float], rng: random.Random, n: int = 4000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median (rounds resampled with replacement)."""
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trimmed_rss_bytes() -> int | None:
    """RSS after glibc's malloc_trim(0) hands freed heap pages back: the live part of RSS. Plain RSS
    also holds what the allocator keeps of freed memory (per-thread arenas: the exporter's), which
    drifts by +-10-30 MiB over 600 steps and read like a leak (sessions 34-38). None without glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_bytes()


@contextmanager
def collector_url(mode: str) -> Iterator[str]:
    if mode == "off":
        yield ""
        return
    if mode == "unreachable":
        import socket

        with socket.socket() as s:  # a port nobody listens on: connection refused, at once
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        return
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.terminate()
        proc.wait(10)


def paired_rounds(job: Job, args: argparse.Namespace, url: str, spill: str) -> Results:
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    overrides = {n: config_overrides(n) for n in names}
    conditions = ["baseline", "baseline-A/A", *names]
    rng = random.Random(args.seed)
    results = Results({c: [] for c in conditions})
    for r in range(args.rounds):
        order = conditions[:]
        rng.shuffle(order)  # no condition always runs first, after GC, or after another one
        for cond in order:
            if cond in overrides:
                attach(job, overrides[cond], url, spill, args.send_interval)
            for _ in range(args.block_warmup):
                train_step(job)
            results.blocks[cond].append(timed_block(job, args.block_steps))
            if job.agent is not None:
                detach(job)
        base = results.blocks["baseline"][-1].cpu_median
        line = "  ".join(f"{c}={results.blocks[c][-1].cpu_median / base:.4f}" for c in conditions[1:])
        print(f"round {r + 1:>3}/{args.rounds}  baseline {base * 1e3:7.2f} ms/step (CPU, median)  {line}", flush=True)
    return results


def report_pairs(results: Results, rng: random.Random) -> list[str]:
    base = results.blocks["baseline"]
    lines = [
        "Median over rounds of (agent block) / (baseline block), 95% bootstrap interval in brackets.",
        "mean: block mean step time (all costs); median: block median step time (every-step hot path);",
        "wall: perf_counter; CPU: the training thread's own CPU time (insensitive to preemption).",
        "",
        "direct: time inside agent code per step / baseline mean step time (accounting, see docstring).",
        "",
        "| condition | wall, mean | wall, median | CPU, mean | CPU, median | direct | exporter CPU/step |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(ratios: list[float]) -> str:
        lo, hi = bootstrap_median_ci(ratios, rng)
        return f"{100 * (statistics.median(ratios) - 1):+.2f}% [{100 * (lo - 1):+.2f}, {100 * (hi - 1):+.2f}]"

    for cond, blocks in results.blocks.items():
        if cond == "baseline":
            continue
        pairs = list(zip(base, blocks, strict=True))
        exp = [b.exporter_cpu for b in blocks if b.exporter_cpu is not None]
        exp_s = f"{statistics.mean(exp) * 1e6:.0f} us" if exp else "-"
        # Agent entry points, plus what clipping through the agent cost beyond torch's own clip.
        direct = (
            cell([1 + (b.agent_direct + b.clip - a.clip) / a.wall for a, b in pairs])
            if cond != "baseline-A/A"
            else "-"
        )
        lines.append(
            f"| {cond} | {cell([b.wall / a.wall for a, b in pairs])} |"
            f" {cell([b.wall_median / a.wall_median for a, b in pairs])} |"
            f" {cell([b.cpu / a.cpu for a, b in pairs])} |"
            f" {cell([b.cpu_median / a.cpu_median for a, b in pairs])} |"
            f" {direct} |"
            f" {exp_s} |"
        )
    mean_base = statistics.median(b.wall for b in base)
    lines.append(f"\nbaseline step time (median of block means): {mean_base * 1e3:.2f} ms")
    return lines


def python_peak(job: Job, steps: int) -> int:
    """tracemalloc peak (bytes) of Python allocations over `steps` training steps."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(steps):
            train_step(job)
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def retained_blocks_per_step(job: Job, steps: int = 20) -> float:
    """Python memory blocks allocated by agent code in one training step and still alive after it.

    The exporter is held off (its lock taken) so the queued step samples stay in memory: this is
    what one step costs the queue until it is shipped. Counted by tracemalloc, restricted to the
    agent's own source files.
    """
    agent_dir = os.path.dirname(tv.__file__)
    with job.agent._exporter._lock:  # the worker blocks on this lock: nothing leaves the queue
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for _ in range(steps):
                train_step(job)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    only_agent = [tracemalloc.Filter(True, os.path.join(agent_dir, "*"))]
    diff = after.filter_traces(only_agent).compare_to(before.filter_traces(only_agent), "filename")
    return sum(d.count_diff for d in diff) / steps


def step_kind(agent: Any) -> str:
    """What the coming step costs the agent: 'expensive' (an FP8 expensive-tier step), 'sampled'
    (a shadow FP8 sample, every fp8_every_steps) or 'ordinary'. Decided, like the agent itself
    decides it, at the end of the previous step."""
    monitors = [m for m in agent._fp8 if m.observing]
    if any(m.expensive_next for m in monitors):
        return "expensive"
    return "sampled" if any(m.every > 1 for m in monitors) else "ordinary"


def memory_run(job: Job, args: argparse.Namespace, url: str, spill: str) -> list[str]:
    lines: list[str] = []
    peak_without = python_peak(job, 30)
    attach(job, {}, url, spill, args.send_interval)
    for _ in range(args.block_warmup):
        train_step(job)
    peak_with = python_peak(job, 30)
    samples: list[tuple[int, int, int | None]] = []
    by_kind: dict[str, list[float]] = {}
    exp0 = exporter_cpu_seconds(job.agent)
    direct0, clip0 = _AGENT_SECONDS[0], _CLIP_SECONDS[0]
    direct0_cpu, clip0_cpu = _AGENT_CPU[0], _CLIP_CPU[0]
    t0, run_cpu0 = time.perf_counter(), time.thread_time()
    every = max(1, args.long_steps // 10)
    for i in range(args.long_steps):
        kind, before = step_kind(job.agent), _AGENT_SECONDS[0]
        train_step(job)
        by_kind.setdefault(kind, []).append(_AGENT_SECONDS[0] - before)
        if i % every == 0 or i == args.long_steps - 1:
            samples.append((i, rss_bytes(), trimmed_rss_bytes()))
    elapsed = time.perf_counter() - t0
    # Less the two timer calls per step: thread_time() is ~0.5 us, but step_kind and RSS reads are not.
    run_cpu = (time.thread_time() - run_cpu0) / args.long_steps
    agent_direct = (_AGENT_SECONDS[0] - direct0) / args.long_steps
    agent_clip = (_CLIP_SECONDS[0] - clip0) / args.long_steps
    agent_direct_cpu = (_AGENT_CPU[0] - direct0_cpu) / args.long_steps
    agent_clip_cpu = (_CLIP_CPU[0] - clip0_cpu) / args.long_steps
    exp1 = exporter_cpu_seconds(job.agent)
    stats = job.agent.stats()
    paired, paired_cpu = paired_clip_delta(job, args.clip_pairs)
    retained = retained_blocks_per_step(job)
    detach(job)
    # Amortised direct cost: the periodic tiers (shadow FP8 every fp8_every_steps, expensive every
    # fp8_expensive_every_steps) land in some timed blocks and not others, which the per-round
    # median understates; over the long run every one of them is counted. Baseline: the same number
    # of steps without agent.
    clip0, clip0_cpu = _CLIP_SECONDS[0], _CLIP_CPU[0]
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(args.long_steps):
        train_step(job)
    base_step = (time.perf_counter() - t0) / args.long_steps
    base_step_cpu = (time.thread_time() - c0) / args.long_steps
    base_clip = (_CLIP_SECONDS[0] - clip0) / args.long_steps
    base_clip_cpu = (_CLIP_CPU[0] - clip0_cpu) / args.long_steps
    # Clipping beyond torch's: the paired measurement when there is one. The difference of the two
    # runs' means is printed beside it; it swings by +-0.1-0.2 ms between runs (docs/performance-agent.md).
    clip_delta = paired if paired is not None else agent_clip - base_clip
    clip_delta_cpu = paired_cpu if paired_cpu is not None else agent_clip_cpu - base_clip_cpu
    amortised = agent_direct + clip_delta
    amortised_cpu = agent_direct_cpu + clip_delta_cpu
    _AGENT_COST.append(
        Cost(
            "trainvitals agent, default config",
            "per step: loss, grad norm, per-group gradient norms, step/compute/wait times, tokens, FLOPs; "
            f"every {_nth(stats.get('fp8_every_steps', 20))}: exact FP8 amax of every Linear input/weight/grad_output "
            "+ headroom/lag/staleness; "
            "every 200th: saturation, underflow, crest, non-finite; shipped to the collector and analysed",
            run_cpu - base_step_cpu,
            amortised_cpu,
            base_step_cpu,
        )
    )
    _HEADLINE.update(
        steps=args.long_steps,
        baseline_step_ms=base_step * 1e3,
        amortised_ms=amortised * 1e3,
        amortised_pct=100 * amortised / base_step,
        amortised_cpu_ms=amortised_cpu * 1e3,
        amortised_cpu_pct=100 * amortised_cpu / base_step_cpu,
        fp8_every_steps=stats.get("fp8_every_steps"),
        entry_points_ms_by_step_kind={kind: statistics.fmean(v) * 1e3 for kind, v in by_kind.items()},
    )
    lines.append(
        f"direct cost amortised over {args.long_steps} steps (every periodic tier included): "
        f"{amortised * 1e3:.3f} ms/step = {100 * amortised / base_step:+.2f}% of the {base_step * 1e3:.1f} ms "
        f"baseline step (agent entry points {agent_direct * 1e3:.3f} ms, clipping through the agent "
        f"{clip_delta * 1e3:+.3f} ms beyond torch's{_clip_source(paired, args.clip_pairs)})"
    )
    lines.append(
        f"  the same in training-thread CPU time (preemption by other processes excluded): "
        f"{amortised_cpu * 1e3:.3f} ms/step = {100 * amortised_cpu / base_step_cpu:+.2f}% of the "
        f"{base_step_cpu * 1e3:.1f} ms baseline step (entry points {agent_direct_cpu * 1e3:.3f} ms, clipping "
        f"{clip_delta_cpu * 1e3:+.3f} ms)"
    )
    lines.append(
        f"  clipping beyond torch's as the difference of the two runs' means: {(agent_clip - base_clip) * 1e3:+.3f} ms "
        f"(CPU {(agent_clip_cpu - base_clip_cpu) * 1e3:+.3f} ms; noisier than the paired steps, shown for comparison)"
    )
    lines.append(
        f"  FP8 shadow samples every {stats.get('fp8_every_steps', '-')} steps (AgentConfig.fp8_every_steps=20, "
        "widened once by the agent when a sample costs over fp8_cost_budget of the step: agent/_fp8_cadence.py)"
    )
    lines.append(
        "  agent entry points per step, by kind: "
        + ", ".join(
            f"{kind} {statistics.fmean(v) * 1e3:.3f} ms (median {statistics.median(v) * 1e3:.3f}, n={len(v)})"
            for kind, v in sorted(by_kind.items(), key=lambda kv: -len(kv[1]))
        )
    )
    mib = 1024 * 1024
    lines.append(f"RSS over {args.long_steps} steps with the default agent (MiB, step: rss / after malloc_trim):")
    lines.append(
        "  " + "  ".join(f"{i}: {rss / mib:.1f}" + (f"/{live / mib:.1f}" if live else "") for i, rss, live in samples)
    )
    half = samples[len(samples) // 2]
    for name, at in (("RSS", 1), ("after malloc_trim (live heap)", 2)):
        first, mid, last = samples[0][at], half[at], samples[-1][at]
        if first is not None and mid is not None and last is not None:
            lines.append(
                f"  {name}: growth first->last {(last - first) / mib:+.1f} MiB, "
                f"second half {(last - mid) / mib:+.1f} MiB"
            )
    if exp0 is not None and exp1 is not None:
        per_step = (exp1 - exp0) / args.long_steps
        step = elapsed / args.long_steps
        lines.append(
            f"exporter thread CPU: {per_step * 1e6:.0f} us/step = {100 * per_step / step:.2f}% of a "
            f"{step * 1e3:.1f} ms step (runs beside training; it competes only for the GIL)"
        )
    lines.append(
        f"exporter: {stats['emitted_records']} queue items emitted, {stats['delivered_batches']} batches "
        f"({stats['delivered_records']} records) delivered, {stats['dropped_records']} dropped, "
        f"{stats['errors']} agent errors"
    )
    lines.append(
        f"tracemalloc peak of Python allocations over 30 steps: without agent {peak_without / 1024:.0f} KiB,"
        f" with agent {peak_with / 1024:.0f} KiB"
    )
    lines.append(f"Python blocks allocated by agent code per step, alive until shipped: {retained:.1f}")
    return lines


def paired_clip_delta(job: Job, pairs: int) -> tuple[float | None, float | None]:
    """What clipping through the agent costs beyond torch's own clip_grad_norm_, in wall and CPU
    seconds: the median, over `pairs` pairs of adjacent steps with the agent attached, of (the
    agent's clip in one step) - (torch's in the next), each the first call after backward. The
    difference of two long runs' means (with and without the agent, minutes apart) swings by more
    than the quantity: adjacent steps share the machine's state. (None, None) when pairs is 0.

    In a step clipped by torch the agent measures its group norms in the optimizer hook, as it
    does for a job that does not clip through it; that step's agent cost is not counted anywhere."""
    if pairs <= 0:
        return None, None
    wall: list[float] = []
    cpu: list[float] = []
    try:
        for _ in range(pairs):
            times = []
            for torch_clip in (False, True):
                job.torch_clip = torch_clip
                before, before_cpu = _CLIP_SECONDS[0], _CLIP_CPU[0]
                train_step(job)
                times.append((_CLIP_SECONDS[0] - before, _CLIP_CPU[0] - before_cpu))
            wall.append(times[0][0] - times[1][0])
            cpu.append(times[0][1] - times[1][1])
    finally:
        job.torch_clip = False
    return statistics.median(wall), statistics.median(cpu)


def _clip_source(paired: float | None, pairs: int) -> str:
    if paired is None:
        return ", difference of the two runs' means"
    return f", median of {pairs} pairs of adjacent steps"


def machine_facts() -> str:
    """The machine the numbers come from: the FP8 tiers' cost follows memory bandwidth and caches,
    so a number without its machine cannot be compared (docs/performance-agent.md)."""
    model = cpu_description(machine_info())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"machine: {model}, {cores} CPUs usable ({os.cpu_count()} online), ATen {capability}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), "
        f"{torch.get_num_interop_threads()} inter-op; load average {os.getloadavg()[0]:.2f}"
    )


class Peer:
    """A per-step logger a user might run instead of the agent: started before its block, called
    after every optimizer step (on the training thread, as in a training loop), stopped after."""

    name = ""
    captures = ""
    direct = True  # its whole training-thread cost is inside after_step (no hooks in the model)

    def missing(self) -> str | None:
        return None

    def start(self, job: Job, tmp: str) -> None:
        self.job = job
        self.last = time.perf_counter()

    def scalars(self, loss: torch.Tensor, grad_norm: Any) -> dict[str, float]:
        now = time.perf_counter()
        out = {
            "loss": loss.item(),  # a device sync on an accelerator, as in most hand-written loggers
            "grad_norm": float(grad_norm),
            "lr": self.job.optimizer.param_groups[0]["lr"],
            "step_seconds": now - self.last,
        }
        self.last = now
        return out

    def after_step(self, step: int, loss: torch.Tensor, grad_norm: Any) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        pass


class JsonLinePeer(Peer):
    name = "hand-written logger (JSON line per step)"
    captures = "4 scalars per step (loss, grad norm, lr, step time) into a local file; no analysis"

    def start(self, job: Job, tmp: str) -> None:
        super().start(job, tmp)
        self.fh = open(os.path.join(tmp, "steps.jsonl"), "w")  # noqa: SIM115 - closed in stop()

    def after_step(self, step: int, loss: torch.Tensor, grad_norm: Any) -> None:
        print(json.dumps({"step": step, **self.scalars(loss, grad_norm)}), file=self.fh, flush=True)

    def stop(self) -> None:
        self.fh.close()


class TensorBoardPeer(Peer):
    name = "TensorBoard scalars (add_scalar x4)"
    captures = "the same 4 scalars per step into an event file (written by a background thread)"

    def missing(self) -> str | None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            return "tensorboard not installed (pip install -e '.[bench]')"
        return None

    def start(self, job: Job, tmp: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().start(job, tmp)
        self.writer = SummaryWriter(log_dir=os.path.join(tmp, "tb"))

    def after_step(self, step: int, loss: torch.Tensor, grad_norm: Any) -> None:
        for key, value in self.scalars(loss, grad_norm).items():
            self.writer.add_scalar(key, value, step)

    def stop(self) -> None:
        self.writer.close()


class WandbWatchPeer(Peer):
    direct = False  # wandb.watch's gradient hooks run inside backward: only the step time shows them

    def __init__(self, log_freq: int) -> None:
        self.log_freq = log_freq
        self.name = f'wandb.watch(log="gradients", log_freq={log_freq}), offline, + wandb.log x4'
        self.captures = (
            f"a 64-bin histogram of every parameter's gradient every {log_freq} step(s), the same 4 "
            "scalars per step; offline files, synced later; no analysis"
        )

    def missing(self) -> str | None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            return "wandb not installed (pip install -e '.[bench]')"
        return None

    def start(self, job: Job, tmp: str) -> None:
        import wandb

        super().start(job, tmp)
        os.environ["WANDB_MODE"] = "offline"  # nothing leaves the machine
        os.environ["WANDB_SILENT"] = "true"
        self.run = wandb.init(project="trainvitals-overhead", dir=tmp, mode="offline")
        self.run.watch(job.model, log="gradients", log_freq=self.log_freq)

    def after_step(self, step: int, loss: torch.Tensor, grad_norm: Any) -> None:
        self.run.log(self.scalars(loss, grad_norm), step=step)

    def stop(self) -> None:
        self.run.unwatch(self.job.model)
        self.run.finish()


def _nth(n: int) -> str:
    return f"{n}th" if n % 10 not in (1, 2, 3) or n % 100 in (11, 12, 13) else f"{n}{'st nd rd'.split()[n % 10 - 1]}"


@dataclass(slots=True)
class Cost:
    """One configuration's cost per step, training-thread CPU time, for the comparison table."""

    name: str
    captures: str
    diff: float | None  # step time minus the baseline's
    direct: float | None  # time inside its own calls (and, for the agent, its clipping)
    base: float  # the baseline step


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _pct(seconds: float | None, base: float) -> float | None:
    return None if seconds is None else 100 * seconds / base


def timed_steps(job: Job, steps: int) -> float:
    """Mean training-thread CPU seconds per step over `steps` steps."""
    c0 = time.thread_time()
    for _ in range(steps):
        train_step(job)
    return (time.thread_time() - c0) / steps


def peer_costs(job: Job, args: argparse.Namespace, tmp: str) -> tuple[list[Cost], list[str]]:
    """Each peer's block between two baseline blocks of the same length (baselines shared)."""
    peers: list[Peer] = [JsonLinePeer(), TensorBoardPeer(), WandbWatchPeer(1), WandbWatchPeer(100)]
    costs: list[Cost] = []
    notes: list[str] = []
    n = args.peer_steps
    before = timed_steps(job, n)
    for peer in peers:
        why = peer.missing()
        if why is not None:
            notes.append(f"{peer.name}: not measured, {why}")
            continue
        peer.start(job, tmp)
        job.peer = peer
        try:
            for _ in range(args.block_warmup):
                train_step(job)
            p0 = _PEER_CPU[0]
            with_peer = timed_steps(job, n)
            direct = (_PEER_CPU[0] - p0) / n
        finally:
            job.peer = None
            peer.stop()
        after = timed_steps(job, n)
        base = (before + after) / 2
        costs.append(Cost(peer.name, peer.captures, with_peer - base, direct if peer.direct else None, base))
        print(f"peer {peer.name}: {(with_peer - base) * 1e3:+.3f} ms/step", flush=True)
        before = after
    return costs, notes


def cost_table(costs: list[Cost]) -> list[str]:
    lines = [
        "Per-step cost of the agent and of its peers, same model, same run, training-thread CPU time.",
        "diff: step time with it minus the baseline's (includes hooks and cache effects; noisy on a",
        "shared machine, +-1-3% of a step); direct: time inside its own calls (the agent: entry points",
        "and clipping beyond torch's, every periodic tier amortised; wandb.watch's hooks are not calls).",
        "",
        "| configuration | diff, ms/step | diff, % of step | direct, ms/step | direct, % of step | captures |",
        "|---|---|---|---|---|---|",
    ]

    def cells(v: float | None, base: float) -> str:
        return "- | -" if v is None else f"{v * 1e3:+.3f} | {100 * v / base:+.2f}%"

    for c in costs:
        lines.append(f"| {c.name} | {cells(c.diff, c.base)} | {cells(c.direct, c.base)} | {c.captures} |")
    return lines


@dataclass(slots=True)
class SpoolIo:
    """What the spool study counts through its wrappers (fsync, Spool.append, the HTTP post)."""

    fsyncs: int = 0
    fsync_seconds: float = 0.0
    bytes_to_disk: int = 0
    request_seconds: float = 0.0

    def minus(self, earlier: SpoolIo) -> SpoolIo:
        return SpoolIo(
            self.fsyncs - earlier.fsyncs,
            self.fsync_seconds - earlier.fsync_seconds,
            self.bytes_to_disk - earlier.bytes_to_disk,
            self.request_seconds - earlier.request_seconds,
        )


def spool_study(job: Job, args: argparse.Namespace, url: str, spill: str) -> list[str]:
    """Exporter cost per batch in the two spool designs, on the same agent, batches alternating.

    write-ahead: every batch appended to the spool file and fsynced, then sent from the file and
    the file removed once acknowledged (the agent's design before this study, and what its last
    pass at exit still does). on-failure: the batch is sent from memory; the spool is written only
    when delivery fails (the default). Each batch holds one send interval of the default agent's
    records (steps, gradient groups, the sampled FP8 records); its pass runs synchronously on this
    thread, so thread CPU time is the exporter's own work. Also counted: fsync calls and time, bytes
    written to the spool, and the time the batch spent in its HTTP request (the window in which a
    killed process loses a batch that is not on disk).
    """
    from trainvitals.agent import _spool

    attach(job, {}, url, spill, 3600.0)  # the worker sleeps; passes are run here, one per batch
    exporter = job.agent._exporter
    transport = exporter._delivery._transport
    steps_per_batch = max(1, round(args.send_interval / _STEP_SECONDS[0]))
    io = SpoolIo()
    real_fsync, real_append, real_post = os.fsync, _spool.Spool.append, transport.post

    def fsync(fd: Any) -> None:
        t0 = time.perf_counter()
        real_fsync(fd)
        io.fsyncs += 1
        io.fsync_seconds += time.perf_counter() - t0

    def append(self: Any, line: bytes) -> bool:
        ok = real_append(self, line)
        io.bytes_to_disk += len(line) + 1 if ok else 0
        return ok

    def post(path: str, body: bytes, timeout: float) -> Any:  # the transport's Reply
        t0 = time.perf_counter()
        try:
            return real_post(path, body, timeout)
        finally:
            io.request_seconds += time.perf_counter() - t0

    os.fsync, _spool.Spool.append, transport.post = fsync, append, post
    passes: dict[str, list[tuple[float, float, SpoolIo]]] = {"write-ahead": [], "on-failure": []}
    try:
        for _ in range(3):  # connection, registration: not part of the steady state
            train_step(job)
        exporter.run_once(deadline=time.monotonic() + 30)
        for i in range(2 * args.spool_batches):
            design = "write-ahead" if i % 2 == 0 else "on-failure"
            for _ in range(steps_per_batch):
                train_step(job)
            before = SpoolIo(io.fsyncs, io.fsync_seconds, io.bytes_to_disk, io.request_seconds)
            c0, t0 = time.thread_time(), time.perf_counter()
            exporter.run_once(deadline=time.monotonic() + 30, write_ahead=design == "write-ahead")
            cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
            passes[design].append((cpu, wall, io.minus(before)))
    finally:
        os.fsync, _spool.Spool.append, transport.post = real_fsync, real_append, real_post
    stats = job.agent.stats()
    detach(job)
    lines = [
        f"spool study: {args.spool_batches} batches per design, alternating, {steps_per_batch} steps per batch "
        f"(one {args.send_interval:g} s send interval of {_STEP_SECONDS[0] * 1e3:.0f} ms steps), spool in {spill}",
        "| design | exporter CPU per batch | pass wall time | fsync per batch | bytes to disk per batch | in request |",
        "|---|---|---|---|---|---|",
    ]

    def ms(values: list[float]) -> str:
        return f"{statistics.fmean(values) * 1e3:.2f} ms (median {statistics.median(values) * 1e3:.2f})"

    for design, rows in passes.items():
        ios = [r[2] for r in rows]
        fsync_s = [x.fsync_seconds for x in ios]
        lines.append(
            f"| {design} | {ms([r[0] for r in rows])} | {ms([r[1] for r in rows])} |"
            f" {statistics.fmean(x.fsyncs for x in ios):.1f} calls, {ms(fsync_s)}, max {max(fsync_s) * 1e3:.2f} ms |"
            f" {statistics.fmean(x.bytes_to_disk for x in ios) / 1024:.1f} KiB |"
            f" {ms([x.request_seconds for x in ios])} |"
        )
    lines.append(
        f"  {stats['delivered_batches']} batches, {stats['delivered_records']} records delivered, "
        f"{stats['failed_attempts']} failed attempts, {stats['errors']} agent errors"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> SystemExit, so the collector stand-in and the temporary spool are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    instrument_agent()
    job = make_job(args)
    rng = random.Random(args.seed + 1)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    with tempfile.TemporaryDirectory(prefix="tv-bench-") as spill, collector_url(args.collector) as url:
        for _ in range(args.warmup):
            train_step(job)
        t0 = time.perf_counter()
        for _ in range(5):
            train_step(job)
        _STEP_SECONDS[0] = (time.perf_counter() - t0) / 5
        if args.block_steps <= 0:
            args.block_steps = max(10, math.ceil(2 * args.send_interval / _STEP_SECONDS[0]))
        machine = machine_facts()
        print(machine, flush=True)
        print(
            f"model d={args.d} layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch}; "
            f"{args.rounds} rounds x {args.block_steps} timed steps per block; collector: {args.collector}",
            flush=True,
        )
        table = report_pairs(paired_rounds(job, args, url, spill), rng) if args.rounds > 0 else []
        memory = memory_run(job, args, url, spill) if args.long_steps > 0 else []
        spool = spool_study(job, args, url, spill) if args.spool_batches > 0 else []
        costs, notes = peer_costs(job, args, spill) if args.peer_steps > 0 else ([], [])
        peers = cost_table(_AGENT_COST + costs) + notes if _AGENT_COST or costs else []
    write_results(
        args.json,
        benchmark="agent_overhead",
        command=sys.argv if argv is None else argv,
        results={
            "torch": torch.__version__,
            "intra_op_threads": torch.get_num_threads(),
            "amortised": _HEADLINE or None,
            "per_step_cost": [
                {"name": c.name, "diff_ms": _ms(c.diff), "diff_pct": _pct(c.diff, c.base),
                 "direct_ms": _ms(c.direct), "direct_pct": _pct(c.direct, c.base)}
                for c in _AGENT_COST + costs
            ],  # fmt: skip
        },
    )
    print()
    print(f"command: {command}")
    print(machine)
    print(f"  at the end: load average {os.getloadavg()[0]:.2f} (other processes on the machine)")
    print()
    for section in (table, memory, peers, spool):
        if section:
            print("\n".join(section))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
