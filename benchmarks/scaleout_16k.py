"""Two collector replicas behind nginx on one PostgreSQL, fed by a simulated 16,384-rank job.

    python benchmarks/scaleout_16k.py [--duration 600] [--speed 1.0] [--step-seconds 6]
        [--send-interval auto] [--port 18400] [--db-prefix tv_scaleout] [--generators 3]
        [--connections 32] [--sample-every 10]

What runs (every process is started and stopped by this script):

- PostgreSQL: a scratch database `<--db-prefix>_<pid>` on 127.0.0.1:5432, dropped at the end.
- Two `trainvitals serve` replicas on --port + 1 and --port + 2 (auth on; each starts its analysis
  child, and the analysis lease lets one of them analyse at a time), with a settle time
  (TRAINVITALS_SETTLE_SECONDS) longer than the send interval: `collector_settle_seconds()`.
- Debian's nginx on --port, as a non-daemon child with a config generated in a temp dir
  (`nginx_config()`; docs/deployment.md shows its upstream and location blocks): least_conn over
  both replicas, keep-alive upstream connections, an ingest retried on the other replica after an
  error or a 502/503 (safe: a batch is idempotent by (run, rank, incarnation, seq)), and the
  answering replica named in an `X-Trainvitals-Upstream` response header so latency can be told
  apart per replica.
- The job: --generators processes, each an asyncio loop with --connections keep-alive connections
  to nginx, simulate the agents of all 16,384 ranks (tp 8 x pp 8 x dp 256, 4 layers per rank).

The job's rate: a step every --step-seconds, by default 6 s, the step of Llama 3 405B's
pre-training on 16,384 H100s (16M-token batches at about 41% MFU: 6 * 405e9 * 16e6 FLOP /
(16,384 * 989e12 FLOP/s * 0.41) = 5.9 s); one batch per rank every --send-interval holding the
steps since its last one, by default the agent's own (`auto`: AgentConfig.send_interval_for, 32 s
at 16,384 ranks), each rank at its phase of the interval (send_phase). A rank's step holds what
the agent sends per step: 1 step record and 5 gradient-norm records (4 layer groups +
`__global__`); the 64 ranks of data-parallel replica 0 (AgentConfig.fp8_ranks 'dp0') add 48 FP8
tensor records (4 layers x 4 Linear x 3 roles). At --speed 1 that is 512 batches/s and 16,896
records/s; the worst case of a fixed 2 s interval and 1 s steps (--step-seconds 1
--send-interval 2) is 8,192 batches/s and 101,376 records/s. --speed S runs the job's clock at
S x real time (a step every step_seconds / S of wall time, a batch per rank every
send_interval / S): every batch holds the same records, only later. Each batch has a due time on
that schedule; `sched lag` is how late the newest batch went out. A bounded lag means the machine
sustains S x real time; a growing one means it does not, and the rate it did send is then the
honest fraction.

Rank 4242 computes 20% longer than its cohort (a straggler: found only once the run is past the
detectors' warm-up and three 50-step windows, which 10 minutes of 6 s steps do not reach) and rank 77
reports a NaN loss at step 12 (a `loss_nonfinite` page), so the findings compared at the end are
not empty.

Sampled every --sample-every s: per replica, the RSS of `serve` and of its analysis child, the
batches it acknowledged per second and their p99 latency (through nginx, as a rank sees it), and a
/metrics scrape of each replica directly (as Prometheus scrapes them); the analysis lag (newest
step any rank delivered minus the newest reduced step). At the end the load stops, the analysis
is given up to --settle seconds to reduce every delivered step, and the run overview
(GET /v1/runs/RUN), the findings and /metrics are fetched from each replica directly and compared
(per-process families and clock-derived gauges aside: docs/metrics.md says which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any, cast

from ingest_throughput import (
    LINEARS,
    PP,
    ROLES,
    TP,
    WORLD_SIZE,
    create_token,
    percentile,
    pg_scratch_db,
    post_json,
    process_tree,
    read_status_kb,
    registration,
    trainvitals_bin,
)

from trainvitals.agent._config import AgentConfig, send_phase
from trainvitals.service import self_metrics
from trainvitals.wire.builders import batch_header, grad_record, step_record, tensor_record
from trainvitals.wire.conventions import Fp8Format, Role

RUN = "scaleout-16k"
PROJECT = "bench"
LLAMA3_405B_STEP_SECONDS = 6.0
"""6 * 405e9 params * 16e6 tokens FLOP per step / (16,384 H100 * 989e12 FLOP/s * 0.41 MFU) = 5.9 s."""
LAYERS_PER_RANK = 4
INCARNATION = 1_712_900_000_000
STRAGGLER_RANK, NAN_RANK, NAN_STEP = 4242, 77, 12
UPSTREAM_HEADER = "X-Trainvitals-Upstream"

# /metrics families that differ between replicas by design (docs/metrics.md, "The collector
# itself"): the per-process ones (request timing, refusals, the write queue and its writers: the
# collector's own list), and gauges computed from the clock at scrape time. Everything else is read
# from the shared database and must agree.
PER_PROCESS_FAMILIES = self_metrics.FAMILIES
CLOCK_FAMILIES = (
    "trainvitals_run_seconds_since_last_step",
    "trainvitals_checkpoint_last_persisted_age_seconds",
    "trainvitals_analysis_seconds_since_last_cycle",
)


# --------------------------------------------------------------------------- nginx and replicas


def nginx_config(*, listen_port: int, replica_ports: list[int], tmp: Path) -> str:
    """The reverse proxy in front of the collector replicas (shown in docs/deployment.md)."""
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=3 fail_timeout=5s;" for p in replica_ports)
    user = "user nobody nogroup;\n" if os.geteuid() == 0 else ""  # a non-root nginx keeps its own user
    return f"""{user}worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream trainvitals {{
        least_conn;
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{listen_port};
        client_max_body_size 32m;        # the collector's own limit (max_body_bytes) answers 413
        client_body_buffer_size 1m;      # batches stay in memory, not in temp files
        location / {{
            proxy_pass http://trainvitals;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_read_timeout 120s;
            # A batch is idempotent by (run, rank, incarnation, seq): retrying a POST on the other
            # replica after an error, a 502 or a full write queue (503) stores it once.
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 2;
            add_header {UPSTREAM_HEADER} $upstream_addr always;
        }}
    }}
}}
"""


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; its log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (an auth refusal is an answer)
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} in {timeout:.0f} s; its log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def replica(
    db_url: str, port: int, log: Path, *, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`trainvitals serve` (auth on, analysis child) on `port`; stopped with SIGINT (graceful)."""
    argv = [trainvitals_bin(), "serve", "--db", db_url, "--port", str(port)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz", proc, "trainvitals serve", log)
        yield proc
    finally:
        _stop(proc, signal.SIGINT)


def collector_settle_seconds(send_interval_s: float) -> float:
    """The replicas' TRAINVITALS_SETTLE_SECONDS. The collector reduces a step once every rank sent it,
    or once it is settle_seconds old (a rank may be dead); a rank sends a step up to one send
    interval after it ends. With the default 30 s against the agent's 32 s at 16,384 ranks, most
    steps would be reduced before their last ranks' rows arrived, then re-dirtied and reduced
    again. One interval plus 15 s, and never less than the default."""
    return max(30.0, send_interval_s + 15.0)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


@contextmanager
def nginx(listen_port: int, replica_ports: list[int]) -> Iterator[subprocess.Popen[bytes]]:
    """nginx in the foreground (daemon off) as our child; its config, logs and temp files in a
    temp dir of its own under /tmp (removed afterwards): when we are root its workers run as
    nobody, who must reach them (a pytest tmp_path sits in a 0700 directory)."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed: run tools/install-system-deps.sh (or apt-get install nginx-light)")
    tmp = Path(tempfile.mkdtemp(prefix="tv_nginx_"))
    tmp.chmod(0o755)
    conf = tmp / "nginx.conf"
    conf.write_text(nginx_config(listen_port=listen_port, replica_ports=replica_ports, tmp=tmp))
    log = tmp / "nginx-error.log"
    log.touch()
    # -e: the startup error log before the config is read (the default is /var/log/nginx, root-owned).
    proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(tmp), "-e", str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_http(f"http://127.0.0.1:{listen_port}/healthz", proc, "nginx", log)
        yield proc
    finally:
        _stop(proc, signal.SIGQUIT)  # graceful: finish the requests in flight
        shutil.rmtree(tmp, ignore_errors=True)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# --------------------------------------------------------------------------- the simulated job


@dataclass(kw_only=True, slots=True, frozen=True)
class Job:
    """The simulated job's schedule (the agent's defaults unless told otherwise)."""

    run: str = RUN
    world_size: int = WORLD_SIZE
    step_seconds: float = LLAMA3_405B_STEP_SECONDS
    """Simulated time per step (what the step records say)."""
    send_interval_s: float = AgentConfig(collector="").send_interval_for(WORLD_SIZE)
    """Simulated time between two batches of one rank: the agent's (AgentConfig.send_interval_for)."""
    speed: float = 1.0
    """Wall seconds per simulated second = 1 / speed."""

    def due(self, rank: int, k: int, t0: float) -> float:
        """Wall time of rank's k-th batch: as the agent's exporter thread, the first at the rank's
        phase of the send interval, then an interval apart (ranks spread evenly over it)."""
        return t0 + (k + 1 - send_phase(rank)) * self.send_interval_s / self.speed

    def steps_done(self, wall: float, t0: float) -> int:
        """Steps finished by `wall` (step n ends at (n + 1) * step_seconds of simulated time)."""
        return int((wall - t0) * self.speed / self.step_seconds)

    def records_per_second(self) -> float:
        dp0 = TP * PP  # ranks of data-parallel replica 0 send the FP8 tensor records
        per_step = self.world_size * (2 + LAYERS_PER_RANK) + dp0 * LAYERS_PER_RANK * len(LINEARS) * len(ROLES)
        return per_step / self.step_seconds


def rank_records(job: Job, rank: int, step: int, t0: float) -> list[dict[str, Any]]:
    """What rank's agent sends for one step (wire builders: the wire format spelled once)."""
    stage, dp_rank = (rank // TP) % PP, rank // (TP * PP)
    compute = 0.81 * (1.2 if rank == STRAGGLER_RANK else 1.0) + (rank % 89) * 1e-4
    loss = float("nan") if (rank, step) == (NAN_RANK, NAN_STEP) else 2.7 - 1e-4 * step
    ts = t0 + (step + 1) * job.step_seconds / job.speed
    recs = [step_record(step=step, ts=ts, step_seconds=job.step_seconds, compute_seconds=compute,
                        wait_seconds=job.step_seconds - compute - 0.01, data_seconds=0.01, loss=loss,
                        tokens=8192, flops=3.6e14, pp_stage=stage, tp_rank=rank % TP, dp_rank=dp_rank)]  # fmt: skip
    layers = range(stage * LAYERS_PER_RANK, (stage + 1) * LAYERS_PER_RANK)
    for group in [*(f"layers.{layer}" for layer in layers), "__global__"]:
        recs.append(grad_record(step=step, group=group, owned_sq=0.011 + (rank % 83) * 1e-4, local_sq=0.02))
    if dp_rank == 0:
        for layer in layers:
            for linear in LINEARS:
                for role, fmt in ROLES:
                    recs.append(tensor_record(step=step, tensor=f"model.layers.{layer}.{linear}",
                                              role=cast("Role", role), format=cast("Fp8Format", fmt),
                                              amax=3.1 + (rank % 71) * 0.01, scale=112.5,
                                              headroom_bits=1.2 + (layer % 5) * 0.1, lag_bits=0.02,
                                              staleness_steps=3))  # fmt: skip
    return recs


@dataclass(slots=True)
class Bucket:
    """One second of one generator's acknowledged batches."""

    latencies: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    records: int = 0
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lag_max: float = 0.0
    newest_step: int = -1


async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes
                ) -> tuple[int, str]:  # fmt: skip
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers.get(UPSTREAM_HEADER.lower(), "")


async def _generate(index: int, generators: int, connections: int, job: Job, port: int, token: str,
                    t0: float, replica_ports: list[int], stop: MpEvent, out: mp.Queue[Any]) -> None:  # fmt: skip
    ranks = sorted(range(index, job.world_size, generators), key=lambda r: job.due(r, 0, t0))
    last_sent = dict.fromkeys(ranks, -1)
    cursor = [0]  # position in the (round, rank) schedule shared by this generator's connections
    buckets: dict[int, Bucket] = defaultdict(Bucket)
    replica_of = {f"127.0.0.1:{p}": i for i, p in enumerate(replica_ports)}
    head = (f"POST /v1/batches HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\n").encode()  # fmt: skip

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while not stop.is_set():
            k, j = divmod(cursor[0], len(ranks))
            cursor[0] += 1
            rank = ranks[j]
            due = job.due(rank, k, t0)
            if (wait := due - time.time()) > 0:
                await asyncio.sleep(wait)
            upto = job.steps_done(due, t0) - 1
            steps = range(last_sent[rank] + 1, upto + 1)
            last_sent[rank] = upto
            records = [rec for s in steps for rec in rank_records(job, rank, s, t0)]
            body = json.dumps({**batch_header(run=job.run, rank=rank, incarnation=INCARNATION, seq=k,
                                              sent_at=time.time()), "records": records}).encode()  # fmt: skip
            while True:  # as the agent does: a failed delivery is retried (the batch is idempotent)
                sent = time.time()
                try:
                    status, upstream = await _send(reader, writer, head, body)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    # nginx closes a keep-alive connection after keepalive_requests (1000) requests
                    # or an idle client_header_timeout (60 s): counted apart, resent at once.
                    status, upstream = 0, type(exc).__name__
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                done = time.time()
                b = buckets[int(done - t0)]
                if status == 0:
                    b.errors[f"connection closed ({upstream})"] += 1
                    continue
                if status == 200:
                    b.latencies[replica_of.get(upstream.rsplit(", ", 1)[-1], -1)].append(done - sent)
                    b.records += len(records)
                    b.lag_max = max(b.lag_max, sent - due)
                    b.newest_step = max(b.newest_step, upto)
                    break
                b.errors[f"HTTP {status}"] += 1
                if stop.is_set():
                    break
                await asyncio.sleep(0.5)
        writer.close()

    async def flush() -> None:
        while not stop.is_set():
            await asyncio.sleep(2.0)
            now_bucket = int(time.time() - t0)
            closed = {s: b for s, b in buckets.items() if s < now_bucket}
            for s in closed:
                del buckets[s]
            out.put(_plain(closed))

    tasks = [asyncio.create_task(connection()) for _ in range(connections)]
    flusher = asyncio.create_task(flush())
    await asyncio.gather(*tasks, return_exceptions=True)
    flusher.cancel()
    out.put(_plain(dict(buckets)))
    out.put(None)  # this generator is done


# What a generator reports, by second since t0: (latencies by replica, records, failures by kind,
# max schedule lag, newest step acknowledged).
Chunk = dict[int, tuple[dict[int, list[float]], int, dict[str, int], float, int]]


def _plain(buckets: dict[int, Bucket]) -> Chunk:
    return {s: (dict(b.latencies), b.records, dict(b.errors), b.lag_max, b.newest_step) for s, b in buckets.items()}


def _generator_main(*args: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through the event
    asyncio.run(_generate(*args))


# --------------------------------------------------------------------------- sampling


@dataclass(slots=True)
class Totals:
    """Everything the generators reported, by second since t0."""

    latencies: dict[int, dict[int, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    records: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lag_max: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    newest_step: int = -1

    def add(self, chunk: Chunk) -> None:
        for s, (lat, records, errors, lag, newest) in chunk.items():
            for rep, values in lat.items():
                self.latencies[s][rep].extend(values)
            self.records[s] += records
            for kind, n in errors.items():
                self.errors[kind] += n
            self.lag_max[s] = max(self.lag_max[s], lag)
            self.newest_step = max(self.newest_step, newest)

    def window(self, lo: int, hi: int, rep: int) -> list[float]:
        return [v for s in range(lo, hi) for v in self.latencies.get(s, {}).get(rep, [])]


@dataclass(kw_only=True, slots=True)
class Sample:
    t: float
    rss_mb: list[tuple[float, float]]
    """Per replica: (serve, its analysis child)."""
    acks_per_s: list[float]
    p99_ms: list[float]
    scrape_ms: list[float]
    records_per_s: float
    sched_lag_s: float
    newest: int
    reduced: int


def _rss_mb(pid: int) -> tuple[float, float]:
    tree = process_tree(pid)
    children = sum(read_status_kb(p, "VmRSS") for p in tree if p != pid)
    return read_status_kb(pid, "VmRSS") / 1024, children / 1024


def _get(url: str, token: str, timeout: float = 120) -> tuple[float, bytes]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return time.perf_counter() - t, body


def _reduced(engine: Any) -> int:
    from sqlalchemy import text

    from trainvitals.service.store.run_keys import run_key

    sql = "SELECT reduced_upto FROM reduction_state WHERE run_id = :key"
    with engine.connect() as conn:
        v = conn.execute(text(sql), {"key": run_key(PROJECT, RUN)}).scalar()  # the run's key in its project
    return -1 if v is None else int(v)


# --------------------------------------------------------------------------- agreement


def comparable_metrics(body: bytes) -> list[str]:
    """The /metrics samples that come from the shared database (sorted)."""
    skip = PER_PROCESS_FAMILIES + CLOCK_FAMILIES
    keep = []
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        # A family's samples carry suffixes (_total, _created, _bucket, ...): match on its stem.
        if name.startswith(("process_", "python_")) or any(name.startswith(f.removesuffix("_total")) for f in skip):
            continue
        keep.append(line)
    return sorted(keep)


VIEWS = {
    "overview": lambda run: f"/v1/runs/{run}",
    "findings": lambda run: f"/v1/runs/{run}/findings",
    "metrics": lambda run: "/metrics",
}


def view(base: str, token: str, run: str, name: str) -> Any:
    """What an operator reads: the run overview, its findings, /metrics (the comparable part)."""
    body = _get(base + VIEWS[name](run), token)[1]
    return comparable_metrics(body) if name == "metrics" else json.loads(body)


def views(base: str, token: str, run: str) -> dict[str, Any]:
    return {name: view(base, token, run, name) for name in VIEWS}


def agreement(bases: list[str], token: str, run: str, attempts: int = 10) -> dict[str, str]:
    """Per view: 'agree' or what differs. The analysis commits every few seconds (a finding's
    updated_at and last_step move with it), so a view agrees when replica A, then B, then A again
    read it back to back and A's two reads are equal (nothing changed in between); a view is
    retried a few times before a difference is called one."""
    verdict: dict[str, str] = {}
    for name in VIEWS:
        for _ in range(attempts):
            a, b, a2 = (view(base, token, run, name) for base in (bases[0], bases[1], bases[0]))
            if a == a2:  # a stable read: the replicas must agree on it
                verdict[name] = "agree" if a == b else _diff(a, b)
                if a == b:
                    break
            time.sleep(1)
        verdict.setdefault(name, f"never stable across three reads in {attempts} tries")
    return verdict


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        return "differ in " + ", ".join(keys)
    if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in a + b):
        only = sorted(set(a) ^ set(b))
        return f"differ in {len(only)} samples, e.g. {only[:3]}"
    return "differ"


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    from trainvitals.service.store.db import make_engine

    ports = [args.port, args.port + 1, args.port + 2]
    if taken := [p for p in ports if not port_free(p)]:
        print(f"error: port(s) {taken} are in use: pick another base with --port", file=sys.stderr)
        return 2
    if nginx_binary() is None:
        print("error: nginx is not installed: run tools/install-system-deps.sh (or apt-get install nginx-light)",
              file=sys.stderr)  # fmt: skip
        return 2
    interval = AgentConfig(collector="", send_interval_s=args.send_interval).send_interval_for(WORLD_SIZE)
    job = Job(step_seconds=args.step_seconds, send_interval_s=interval, speed=args.speed)
    bases = [f"http://127.0.0.1:{p}" for p in ports[1:]]
    tmp = Path(tempfile.mkdtemp(prefix="tv_scaleout_"))
    samples: list[Sample] = []
    totals = Totals()
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        db_url = stack.enter_context(pg_scratch_db(args.db_prefix))
        ingest_token = create_token(db_url, project=PROJECT, scope="ingest")  # migrates once, before both start
        read_token = create_token(db_url, project=PROJECT, scope="read")
        env = {"TRAINVITALS_LOG_LEVEL": "warning",
               "TRAINVITALS_SETTLE_SECONDS": f"{collector_settle_seconds(job.send_interval_s):g}"}  # fmt: skip
        procs = [stack.enter_context(replica(db_url, p, tmp / f"replica-{i}.log", env=env))
                 for i, p in enumerate(ports[1:])]  # fmt: skip
        proxy_proc = stack.enter_context(nginx(ports[0], ports[1:]))
        proxy = f"http://127.0.0.1:{ports[0]}"
        status, body = post_json(proxy, "/v1/runs", registration(RUN), ingest_token)
        if status >= 300:
            raise RuntimeError(f"registration through nginx failed: {status} {body!r}")
        engine = make_engine(db_url)
        stack.callback(engine.dispose)
        print(f"replicas: {' | '.join(bases)} behind nginx {proxy}; database {db_url.rsplit('/', 1)[1]}", flush=True)

        ctx = mp.get_context("fork")
        stop = ctx.Event()
        out: mp.Queue[Any] = ctx.Queue()
        t0 = time.time() + 1.0
        gens = [ctx.Process(target=_generator_main, name=f"job-{i}",
                            args=(i, args.generators, args.connections, job, ports[0], ingest_token, t0,
                                  ports[1:], stop, out))
                for i in range(args.generators)]  # fmt: skip
        for g in gens:
            g.start()

        def cpu_now() -> dict[str, float]:
            groups = _cpu_groups(procs, proxy_proc, [g.pid for g in gens if g.pid], db_url)
            return {**groups, "_t": time.monotonic()}

        cpu0 = cpu_now()

        def drain(block_s: float = 0.0) -> int:
            ended = 0
            deadline = time.monotonic() + block_s
            while True:
                try:
                    chunk = out.get(timeout=max(0.01, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - queue.Empty
                    return ended
                if chunk is None:
                    ended += 1
                else:
                    totals.add(chunk)

        header = (f"{'t s':>5} {'acks/s A':>9} {'acks/s B':>9} {'p99 A ms':>9} {'p99 B ms':>9} "
                  f"{'RSS A MB':>12} {'RSS B MB':>12} {'scrape ms':>11} {'records/s':>10} {'sched lag':>9} "
                  f"{'newest':>7} {'reduced':>7} {'lag':>5}")  # fmt: skip
        print(header + "\n" + "-" * len(header), flush=True)
        try:
            next_sample = t0 + args.sample_every
            while time.time() < t0 + args.duration:
                drain(max(0.0, next_sample - time.time()))
                if time.time() < next_sample:
                    continue
                lo, hi = (
                    int(next_sample - t0 - args.sample_every),
                    int(next_sample - t0) - 2,
                )  # the last 2 s are in flight
                span = max(1, hi - lo)
                scrape = [_get(f"{b}/metrics", read_token)[0] * 1e3 for b in bases]
                s = Sample(
                    t=next_sample - t0,
                    rss_mb=[_rss_mb(p.pid) for p in procs],
                    acks_per_s=[len(totals.window(lo, hi, i)) / span for i in range(2)],
                    p99_ms=[percentile(totals.window(lo, hi, i), 0.99) * 1e3 for i in range(2)],
                    scrape_ms=scrape,
                    records_per_s=sum(totals.records.get(x, 0) for x in range(lo, hi)) / span,
                    sched_lag_s=max((totals.lag_max.get(x, 0.0) for x in range(lo, hi)), default=0.0),
                    newest=totals.newest_step,
                    reduced=_reduced(engine),
                )
                samples.append(s)
                print(_row(s), flush=True)
                next_sample += args.sample_every
        finally:
            cpu1 = cpu_now()
            stop.set()
            ended, deadline = 0, time.monotonic() + 60
            while ended < len(gens) and time.monotonic() < deadline:
                ended += drain(1.0)
            for g in gens:
                g.join(10)
                if g.is_alive():
                    g.kill()
                    g.join()
        wall = time.time() - t0
        settle_t = time.monotonic()
        while _reduced(engine) < totals.newest_step and time.monotonic() - settle_t < args.settle:
            time.sleep(2)
        settled = _reduced(engine), time.monotonic() - settle_t
        verdict = agreement(bases, read_token, RUN)
        storage = _storage(engine)
        busy = {k: (cpu1[k] - cpu0.get(k, 0.0)) / (cpu1["_t"] - cpu0["_t"]) for k in cpu1 if k != "_t"}
    _summary(args, job, samples, totals, wall, settled, verdict, busy)
    print("storage: " + "; ".join(f"{t} {rows:,} rows, {size / 2**20:,.0f} MiB ({size / max(rows, 1):.0f} B/row)"
                                  for t, rows, size in storage))  # fmt: skip
    return 0 if all(v == "agree" for v in verdict.values()) else 1


SIZED_TABLES = ("steps", "grad_stats", "tensor_stats", "batches", "step_summaries", "grad_summaries",
              "tensor_summaries", "rank_windows")  # fmt: skip


def _storage(engine: Any) -> list[tuple[str, int, int]]:
    """(table, rows, bytes with indexes and TOAST) for docs/deployment.md's sizing."""
    from sqlalchemy import text

    with engine.connect() as conn:
        return [(t, int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() or 0),
                 int(conn.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar() or 0))
                for t in SIZED_TABLES]  # fmt: skip


def _cpu_groups(procs: list[subprocess.Popen[bytes]], proxy: subprocess.Popen[bytes], job_pids: list[int],
                db_url: str) -> dict[str, float]:  # fmt: skip
    """CPU seconds so far of each part (PostgreSQL: the backends now connected to the scratch database,
    so the pool's connections must be open at both ends, as they are under load)."""
    from ingest_throughput import _postgres_backends, cpu_seconds

    out = {"nginx": cpu_seconds(process_tree(proxy.pid)), "postgres": cpu_seconds(list(_postgres_backends(db_url))),
           "job": cpu_seconds(job_pids)}  # fmt: skip
    for name, proc in zip("AB", procs, strict=True):
        out[f"serve {name}"] = cpu_seconds([proc.pid])
        out[f"analysis {name}"] = cpu_seconds([p for p in process_tree(proc.pid) if p != proc.pid])
    return out


def _row(s: Sample) -> str:
    rss = [f"{a:.0f}+{c:.0f}" for a, c in s.rss_mb]
    return (f"{s.t:>5.0f} {s.acks_per_s[0]:>9.0f} {s.acks_per_s[1]:>9.0f} {s.p99_ms[0]:>9.0f} {s.p99_ms[1]:>9.0f} "
            f"{rss[0]:>12} {rss[1]:>12} {max(s.scrape_ms):>11.0f} {s.records_per_s:>10,.0f} {s.sched_lag_s:>8.1f}s "
            f"{s.newest:>7} {s.reduced:>7} {s.newest - s.reduced:>5}")  # fmt: skip


def _summary(args: argparse.Namespace, job: Job, samples: list[Sample], totals: Totals, wall: float,
             settled: tuple[int, float], verdict: dict[str, str], busy: dict[str, float]) -> None:  # fmt: skip
    need_batches = job.world_size / job.send_interval_s
    sent = sum(len(v) for per in totals.latencies.values() for v in per.values())
    records = sum(totals.records.values())
    steady = samples[len(samples) // 3 :] or samples  # the first third is the ramp
    all_lat = [v for per in totals.latencies.values() for vs in per.values() for v in vs]
    print(f"\njob: {job.world_size} ranks, step {job.step_seconds:g} s, a batch per rank every "
          f"{job.send_interval_s:g} s (collector settle {collector_settle_seconds(job.send_interval_s):g} s): "
          f"at real time {need_batches:,.0f} batches/s, {job.records_per_second():,.0f} records/s; "
          f"run at --speed {job.speed:g} for {wall:.0f} s")  # fmt: skip
    print(f"acknowledged: {sent:,} batches ({sent / wall:,.0f}/s), {records:,} records ({records / wall:,.0f}/s), "
          f"resent: {dict(totals.errors) or 'none'}; p50 {percentile(all_lat, 0.5) * 1e3:.0f} ms, "
          f"p99 {percentile(all_lat, 0.99) * 1e3:.0f} ms through nginx")  # fmt: skip
    if steady:
        lag = [s.sched_lag_s for s in steady]
        # Kept up: batches go out when due, give or take the requests' latency (bounded by 10 s, or by
        # two intervals of a short one).
        kept_up = lag[-1] < min(2 * job.send_interval_s / job.speed, 10.0)
        # Kept up: the job ran at --speed. Fell behind: what was acknowledged per second in the steady
        # part, over what real time needs, is the fraction the machine sustains.
        steady_batches = sum(s.acks_per_s[0] + s.acks_per_s[1] for s in steady) / len(steady)
        fraction = job.speed if kept_up else steady_batches / need_batches
        print(f"schedule lag (how late the newest batch went out) over the last two thirds: max {max(lag):.1f} s, "
              f"last {lag[-1]:.1f} s -> {'kept up' if kept_up else 'fell behind'}; steady {steady_batches:,.0f} "
              f"batches/s; fraction of real time sustained: {fraction:.3f}")  # fmt: skip
        for i, name in enumerate("AB"):
            serve_rss = [s.rss_mb[i][0] for s in samples]
            child_rss = [s.rss_mb[i][1] for s in samples]
            print(f"replica {name}: serve RSS {min(serve_rss):.0f}-{max(serve_rss):.0f} MB, analysis child "
                  f"{min(child_rss):.0f}-{max(child_rss):.0f} MB; share of batches "
                  f"{sum(len(per.get(i, [])) for per in totals.latencies.values()) / max(sent, 1):.0%}")  # fmt: skip
        lags = [s.newest - s.reduced for s in steady]
        print(f"analysis lag (newest delivered - newest reduced step) over the last two thirds: "
              f"{min(lags)}-{max(lags)} steps, last {lags[-1]}")  # fmt: skip
        print(f"scrape of each replica's /metrics: max {max(max(s.scrape_ms) for s in samples):.0f} ms")
    print("cores busy during the load: " + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
          + f" (of {os.cpu_count()}; load average now {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"after the load: reduced step {settled[0]} of newest {totals.newest_step} within {settled[1]:.0f} s")
    for key, v in verdict.items():
        print(f"agreement, {key}: {v}")


def _interval(text: str) -> float | None:
    """--send-interval: seconds, or 'auto' (None: AgentConfig's automatic interval)."""
    if text == "auto":
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0 or 'auto'")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--speed", type=float, default=1.0, help="the job's clock as a fraction of real time")
    parser.add_argument("--step-seconds", type=float, default=LLAMA3_405B_STEP_SECONDS,
                        help="simulated step time; 6 s: Llama 3 405B on 16,384 H100s (worst case: 1)")  # fmt: skip
    parser.add_argument("--send-interval", type=_interval, default=None, metavar="SECONDS|auto",
                        help="per rank; auto: the agent's (AgentConfig.send_interval_for, 32 s at 16,384 "
                        "ranks; worst case: 2)")  # fmt: skip
    parser.add_argument("--port", type=int, default=18400, help="nginx; the replicas on +1 and +2")
    parser.add_argument("--db-prefix", default="tv_scaleout", help="scratch database name prefix (+ _<pid>)")
    parser.add_argument("--generators", type=int, default=3, help="load-generator processes")
    parser.add_argument("--connections", type=int, default=32, help="keep-alive connections per generator")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=180.0, help="seconds the analysis gets after the load")
    args = parser.parse_args()
    if args.speed <= 0 or args.duration <= 0 or args.generators < 1 or args.connections < 1:
        parser.error("--speed and --duration must be > 0, --generators and --connections >= 1")
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} cores, load average before {os.getloadavg()[0]:.2f}")
    sys.exit(run(args))


if __name__ == "__main__":
    main()
