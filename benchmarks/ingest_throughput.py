"""Sustained ingest throughput of a real collector, driven by load-generator processes on loopback.

    python benchmarks/ingest_throughput.py [--backends sqlite,postgresql] [--seconds 40] [--warmup 10]
        [--clients 6] [--rate 0] [--steps-per-batch 4] [--layers-per-rank 4] [--workers 1]
        [--no-analysis | --analysis-thread] [--floor-seconds 10] [--port P] [--db-prefix tv_bench]

For each backend: start `trainvitals serve --db URL --port P` as a subprocess (analysis worker on,
in its own child process as `serve` does by default; `--analysis-thread` runs it as a thread of the
collector, `--no-analysis` not at all), register a run of world_size 16,384 (tp 8 x pp 8 x dp 256), then let
`--clients` load-generator processes POST wire-format batches over keep-alive HTTP/1.1 connections
(`KeepAliveConnection`, a minimal client on a socket), one request in flight per process. A batch
is what one rank's agent sends per interval: `--steps-per-batch` steps of 1 step record + one grad
record per layer it holds plus `__global__` + 4 Linear modules x 3 roles of FP8 tensor records per
layer (the cheap tier), i.e. 216 records (37 KB of JSON) with the defaults. Ranks advance
together, round-robin, so every (rank, incarnation, seq) is distinct and step numbers grow like a
real run's.

Two modes (named in the header line; the `offered` column says which):

- Closed loop (`--rate 0`, the default): each client sends its next batch as soon as the answer to
  its last one is back. This finds capacity; at saturation p50/p99 are queueing at capacity, not
  latency at some rate.
- Open loop (`--rate R`, records/s offered by the whole job): the clients together send
  R / records-per-batch batches/s on a fixed schedule, evenly interleaved: client i sends its k-th
  batch at start + (k * clients + i) / batches_per_s, like agents sending on their interval. A
  client behind its schedule skips nothing and sends at once, so a backlog shows. p50/p99 run from
  each batch's SCHEDULED send time to its answer (no coordinated omission), over the batches due in
  the window. One due but not sent when the load stops (1 s after the window, so it is a real
  backlog) counts with the lower bound stop - due, and a percentile that rests on such a bound is
  printed as `>x`. `late ms`: how far behind schedule a send started, at most. A line per backend
  gives achieved vs offered records/s, the lateness in the window's first and last quarter (growing:
  a backlog) and the batches due but not sent, and says KEPT UP or DID NOT KEEP UP. Each client keeps
  ONE connection with one request in flight, so it keeps its schedule only while answers take less
  than its interval (clients / batches_per_s): size `--clients` by Little's law (batches/s x answer
  time). When that product exceeds `--clients`, a line "rate R needs more clients: ..." says how
  many; sends later than one interval with enough clients are reported as stalls.

Measured after `--warmup` seconds, over `--seconds`: acknowledged records/s and batches/s, p50/p99
request latency (see the modes above), CPU seconds per second of the collector, the PostgreSQL
backends and the load generators (the machine has few cores: everything here shares them), and the
collector's RSS (VmRSS at the end and VmHWM, from /proc/<pid>/status). Under the table, where
that CPU goes: the collector's by part (event loop, batch writers, other threads, analysis child;
per thread from /proc), and on PostgreSQL the server's by the collector process each backend
serves (its `application_name`). Then the batch writers over the window, from the collector's own
/metrics (`trainvitals_ingest_group_*`, scraped with a read token of another project, so no run's
families are built): how busy its writer threads were (near 100%: bound by the writers; well
below: they wait for batches), batches and milliseconds a group, groups a second. Not with
`--workers` N > 1, where a scrape reaches one process of N.

PostgreSQL also gets a line on the server over the window (server-wide counters, so other
databases' work counts too): the WAL written per second and per acknowledged record, and the
checkpoints, how many max_wal_size requested and how long their sync phase took. A commit that
waits for the WAL flush waits behind that sync phase: the collector's ingest commits do not by
default (`synchronous_commit` off for them; `--ingest-synchronous-commit` runs the collector with
TRAINVITALS_INGEST_SYNCHRONOUS_COMMIT=true, the database's own setting, on by default).

The floor row (`--floor-seconds`, before and after each backend's ingest run): the same records,
already row tuples, inserted from this one process into the same tables with nothing else in the way
(SQLite `executemany`, PostgreSQL binary COPY; `--clients` batches per commit, committed as the
collector commits them), and ingest's ratio to it. The floor is measured on both sides because a
shared host's speed drifts over minutes (other guests on the same cores): the ratio is to the mean
of the two, and when they differ by more than a tenth a line says so and gives the ratio to each.

The SQLite file and the PostgreSQL scratch database are removed at the end; every process this
script starts is stopped by it. scrape_16k.py and postmortem_queries.py import the collector and
scratch-database helpers from here.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

from bench_results import add_json_arg, cpu_description, machine, write_results

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
WORLD_SIZE = 16_384
TP, PP = 8, 8
DP = WORLD_SIZE // (TP * PP)
LAYERS = 32
LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
ROLES = (("input", "e4m3"), ("weight", "e4m3"), ("grad_output", "e5m2"))
_CLK_TCK = os.sysconf("SC_CLK_TCK")
OPEN_LOOP_GRACE_S = 1.0


# --------------------------------------------------------------------------- shared helpers


def trainvitals_bin() -> str:
    """The console script of the interpreter running this file (the project's virtualenv)."""
    exe = Path(sys.executable).parent / "trainvitals"
    return str(exe) if exe.exists() else shutil.which("trainvitals") or "trainvitals"


def add_shared_args(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """--port and --db-prefix, so that a benchmark runs beside other work on a shared machine."""
    if server:
        parser.add_argument("--port", type=int, default=0,
                            help="port of the collector this benchmark starts (default: one the OS picks)")  # fmt: skip
    parser.add_argument("--db-prefix", default="tv_bench",
                        help="name prefix of the scratch databases (PostgreSQL: <prefix>_<what>_<pid>)")  # fmt: skip


def cpu_model() -> str:
    """The CPU by name, family and model, which the numbers depend on as much as the code."""
    return cpu_description(machine())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def pg_scratch_db(prefix: str) -> Iterator[str]:
    """A fresh PostgreSQL database (SQLAlchemy URL), dropped afterwards even on error."""
    import psycopg

    name = f"{prefix}_{os.getpid()}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def sqlite_scratch_db(prefix: str) -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix=f"{prefix}_")
    try:
        yield f"sqlite:///{tmp}/trainvitals.db"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def scratch_db(backend: str, prefix: str) -> Iterator[str]:
    with sqlite_scratch_db(prefix) if backend == "sqlite" else pg_scratch_db(prefix) as url:
        yield url


@dataclass(kw_only=True, slots=True)
class CollectorProcess:
    proc: subprocess.Popen[bytes]
    port: int
    command: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def collector(
    url: str,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    workers: int = 1,
    extra_args: tuple[str, ...] = (),
    port: int = 0,
) -> Iterator[CollectorProcess]:
    """`trainvitals serve` as a subprocess on `port` (0: one the OS picks); waits for /healthz;
    terminated (then killed) on exit."""
    port = port or free_port()
    argv = [trainvitals_bin(), "serve", "--db", url, "--port", str(port), "--workers", str(workers), *extra_args]
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"collector exited with {proc.returncode}: {' '.join(argv)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("collector did not answer /healthz in time")
            time.sleep(0.2)
        yield CollectorProcess(proc=proc, port=port, command=" ".join(argv))
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown stops the analysis worker
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def create_token(url: str, *, project: str, scope: str) -> str:
    """A bearer token through the CLI (which also migrates the empty database), as an operator would."""
    out = subprocess.run(
        [trainvitals_bin(), "token", "create", "--db", url, "--project", project, "--scope", scope],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def post_json(base: str, path: str, body: object, token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def registration(run: str) -> dict[str, object]:
    """A 16,384-rank, 8B-class FP8 run: what rank 0's agent registers."""
    return {
        "run": run,
        "project": "bench",
        "started_at": time.time(),
        "model": {
            "layers": LAYERS,
            "hidden": 4096,
            "heads": 32,
            "vocab": 128_256,
            "seq_len": 8192,
            "params": 8_000_000_000,
        },
        "parallelism": {
            "world_size": WORLD_SIZE,
            "tp": TP,
            "pp": PP,
            "dp": DP,
            "micro_batch": 1,
            "global_batch": 2048,
        },
        "hardware": {"gpu_type": "H100-SXM", "gpu_count": WORLD_SIZE, "gpus_per_node": 8},
        "fp8": {"enabled": True},
    }


def read_status_kb(pid: int, key: str) -> int:
    """VmRSS / VmHWM in kB from /proc/<pid>/status (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _stat_cpu_seconds(stat: str) -> float | None:
    """utime + stime in seconds from a /proc stat file (a process's or a thread's); None when it
    cannot be read (the process or thread is gone)."""
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (children not included), in seconds."""
    return sum(filter(None, (_stat_cpu_seconds(f"/proc/{pid}/stat") for pid in pids)), 0.0)


# The parts of the collector's CPU, in the order printed: which thread or process does what
# (`trainvitals serve` names its threads for the OS: service/thread_names.py).
COLLECTOR_PARTS = ("event loop", "batch writer", "other threads", "analysis child")


def _part_of(pid: int, tid: int, comm: str, analysis_pids: set[int]) -> str:
    if pid in analysis_pids:
        return "analysis child"
    if tid == pid:
        return "event loop"  # serve's main thread: uvicorn's loop, the route (HTTP, decode, rows)
    if comm.startswith("batch-writer"):
        return "batch writer"
    return "other threads"  # the WAL checkpointer, the ingest summary, thread pools


def thread_cpu_seconds(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (its part of COLLECTOR_PARTS, utime + stime in seconds) for every thread of
    these processes, read from /proc."""
    analysis = set()
    for pid in pids:
        try:
            if b"analyse" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                analysis.add(pid)
        except OSError:
            pass
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            seconds = _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
            if seconds is not None:
                out[pid, tid] = (_part_of(pid, tid, comm, analysis), seconds)
    return out


def cpu_seconds_by_part(
    before: dict[Any, tuple[str, float]],
    after: dict[Any, tuple[str, float]],
    parts_in_order: tuple[str, ...] = COLLECTOR_PARTS,
) -> dict[str, float]:
    """CPU seconds spent between two readings (thread_cpu_seconds, or postgres_cpu_seconds with
    SERVER_PARTS), summed by part. A thread or backend started since counts from zero; one that
    ended since is not counted (its CPU left with it: a thread pool's idle worker, not the loop,
    the writers or the analysis child, which live as long as the collector; a pooled connection
    the collector closed)."""
    parts = dict.fromkeys(parts_in_order, 0.0)
    for key, (part, seconds) in after.items():
        parts[part] += seconds - before.get(key, (part, 0.0))[1]
    return parts


# The parts of the PostgreSQL server's CPU, by the client each backend serves (the collector names
# its connections: store/db.py's application names): `serve` (ingest's writers, and the reads of
# routes and /metrics, which the benchmark does not call), the analysis child, and anything else
# connected to the scratch database.
SERVER_PARTS = ("serve", "analysis child", "other")


def _server_part_of(application_name: str) -> str:
    from trainvitals.service.store import db

    parts = {db.SERVE_APPLICATION_NAME: "serve", db.ANALYSE_APPLICATION_NAME: "analysis child"}
    return parts.get(application_name, "other")


def postgres_cpu_seconds(backends: dict[int, str]) -> dict[int, tuple[str, float]]:
    """pid -> (its part of SERVER_PARTS, utime + stime in seconds) for these PostgreSQL backends
    (pid -> application_name, as `_postgres_backends` reads them); a backend gone since is left out."""
    out = {}
    for pid, application_name in backends.items():
        seconds = _stat_cpu_seconds(f"/proc/{pid}/stat")
        if seconds is not None:
            out[pid] = (_server_part_of(application_name), seconds)
    return out


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (the worker processes of `serve --workers N`)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --------------------------------------------------------------------------- load generator


def _layers_of(rank: int, layers_per_rank: int) -> list[int]:
    stage = (rank // TP) % PP  # tp innermost, then pp, then dp
    first = stage * layers_per_rank
    return list(range(first, first + layers_per_rank))


def batch_template(run: str, rank: int, *, steps_per_batch: int, layers_per_rank: int) -> tuple[bytes, int]:
    """The JSON body of a batch of any rank congruent to `rank` mod tp*pp, with placeholders for
    rank, dp rank, seq, steps and ts (filled by one bytes.join per request: the load generators
    share the machine's cores with the collector they measure, so they must cost little CPU)."""
    records: list[str] = []
    layers = _layers_of(rank, layers_per_rank)
    stage = (rank // TP) % PP
    for k in range(steps_per_batch):
        st, ts = f"@S{k}@", f"@T{k}@"
        records.append(
            f'{{"kind":"step","step":{st},"ts":{ts},"step_seconds":1.0{rank % 97:02d},'
            f'"compute_seconds":0.81,"wait_seconds":0.17,"data_seconds":0.01,"loss":2.7{rank % 89},'
            f'"tokens":8192,"flops":3.6e+14,"lr":0.0003,"grad_norm":0.93,"pp_stage":{stage},'
            f'"tp_rank":{rank % TP},"dp_rank":@D@}}'
        )
        for layer in [*layers, None]:
            group = "__global__" if layer is None else f"layers.{layer}"
            records.append(
                f'{{"kind":"grad","step":{st},"group":"{group}","owned_sq":0.0{rank % 83 + 11},'
                f'"local_sq":0.{rank % 79 + 12},"nonfinite":0}}'
            )
        for layer in layers:
            for linear in LINEARS:
                for role, fmt in ROLES:
                    records.append(
                        f'{{"kind":"tensor","step":{st},"tensor":"model.layers.{layer}.{linear}",'
                        f'"role":"{role}","format":"{fmt}","amax":3.{rank % 71 + 10},"scale":112.5,'
                        f'"headroom_bits":1.{rank % 67 + 10},"lag_bits":0.02,"staleness_steps":3}}'
                    )
    body = (
        f'{{"wire_version":1,"run":"{run}","rank":@R@,"incarnation":1712900000000,"seq":@Q@,'
        f'"sent_at":@T0@,"records":[{",".join(records)}]}}'
    )
    return body.encode(), len(records)


class KeepAliveConnection:
    """POSTs JSON bodies to one path over one keep-alive HTTP/1.1 socket, one request at a time.

    The load generators share the 2 cores with the collector they measure, so what they spend is
    taken from it. http.client spent ~90 us a request more than this (measured in isolation): its
    header objects and the email parser it reads an answer's head with. Here the request's head is
    one bytes template, and only the answer's status and Content-Length are read."""

    def __init__(self, port: int, path: str, token: str) -> None:
        self._address = ("127.0.0.1", port)
        self._head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: %d\r\n\r\n"
        ).encode()
        self._sock: socket.socket | None = None

    def post(self, body: bytes) -> int:
        """The answer's status code (its body is read and dropped). Once more on a new connection
        when the collector closed this one before answering: it closes keep-alive connections idle
        for `keep_alive_seconds` (a slow open loop), and a resent batch is a duplicate it acknowledges."""
        try:
            return self._post(body)
        except ConnectionError:
            self.close()
            return self._post(body)

    def _post(self, body: bytes) -> int:
        if self._sock is None:
            self._sock = socket.create_connection(self._address, timeout=120)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = self._sock
        sock.sendall(self._head % len(body) + body)
        buf = b""
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv(sock)
        head = buf[:end].lower()
        status = int(head[9:12])
        length = re.search(rb"\r\ncontent-length: *(\d+)", head)
        if length is None:  # the collector always answers with a length; anything else is a bug here
            raise RuntimeError(f"answer without Content-Length: {head[:200]!r}")
        missing = end + 4 + int(length[1]) - len(buf)
        while missing > 0:
            missing -= len(self._recv(sock))
        if b"\r\nconnection: close" in head:
            self.close()
        return status

    def _recv(self, sock: socket.socket) -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            self.close()
            raise ConnectionError("the collector closed the connection before answering")
        return chunk

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _client_main(
    index: int,
    clients: int,
    port: int,
    run: str,
    steps_per_batch: int,
    layers_per_rank: int,
    token: str,
    stop: MpEvent,
    out: mp.Queue,  # type: ignore[type-arg]
    schedule: tuple[float, float] | None = None,
) -> None:
    """One load generator: ranks index, index + clients, ...; one keep-alive connection.

    schedule None: closed loop, the next request as soon as the answer is back. schedule
    (start, batches_per_s): open loop, the k-th batch is due at start + (k * clients + index) /
    batches_per_s (time.monotonic, one clock for all processes) and is sent then, or at once when
    the client is behind: nothing is skipped, so a backlog shows as lateness and latency."""
    ranks = list(range(index, WORLD_SIZE, clients))
    templates: dict[int, tuple[list[bytes], int]] = {}  # by rank mod tp*pp: the layout repeats per dp group
    conn = KeepAliveConnection(port, "/v1/batches", token)
    samples: list[tuple[float, float, int]] = []  # (done monotonic, latency s, records)
    # Open loop: (schedule slot, sent monotonic, done monotonic, answered 200) of every answered batch.
    timed: list[tuple[int, float, float, bool]] = []
    errors = 0
    seq = 0
    k = 0  # open loop: this client's batches so far
    while not stop.is_set():
        for rank in ranks:
            if stop.is_set():
                break
            key = rank % (TP * PP)
            if key not in templates:
                template, n = batch_template(run, key, steps_per_batch=steps_per_batch, layers_per_rank=layers_per_rank)
                templates[key] = (re.split(rb"@([A-Z][0-9]*)@", template), n)
            parts, n = templates[key]
            slot, due = 0, 0.0
            if schedule is not None:
                slot = k * clients + index
                due = schedule[0] + slot / schedule[1]
                while (wait := due - time.monotonic()) > 0 and not stop.is_set():
                    time.sleep(min(wait, 0.25))
                if stop.is_set():
                    break  # not sent: counted as missing if it was due in the window
                k += 1
            now = b"%.3f" % time.time()
            values = {b"Q": b"%d" % seq, b"R": b"%d" % rank, b"D": b"%d" % (rank // (TP * PP))}
            for k_step in range(steps_per_batch):
                values[b"S%d" % k_step] = b"%d" % (seq * steps_per_batch + k_step)
                values[b"T%d" % k_step] = now
            # parts alternates literal text and placeholder names: one join per request.
            body = b"".join(values[p] if i % 2 else p for i, p in enumerate(parts))
            t0 = time.monotonic()
            status = conn.post(body)
            t1 = time.monotonic()
            if schedule is not None:
                timed.append((slot, t0, t1, status == 200))
            if status == 200:
                # Open loop: from the scheduled send time (no coordinated omission), else from the send.
                samples.append((t1, t1 - (due if schedule is not None else t0), n))
            else:
                errors += 1
        seq += 1
    conn.close()
    out.put((index, samples, errors, timed))


# --------------------------------------------------------------------------- one measurement


@dataclass(kw_only=True, slots=True)
class IngestResult:
    backend: str
    records_per_s: float
    batches_per_s: float
    records_per_batch: int
    body_kb: float
    p50_ms: float
    p99_ms: float
    errors: int
    collector_cpu: float
    collector_processes: int
    """Processes counted in collector_cpu and the RSS columns: `serve`, its --workers, its analysis child."""
    collector_parts: dict[str, float]
    """collector_cpu by COLLECTOR_PARTS, cores busy on average."""
    postgres_cpu: float
    server_parts: dict[str, float]
    """postgres_cpu by SERVER_PARTS, cores busy on average (all 0 on SQLite)."""
    clients_cpu: float
    rss_mb: float
    hwm_mb: float
    stored_rows: int
    reduced: str
    """'reduced step / newest delivered step' when the load stopped ('-': analysis off)."""
    command: str
    clients: int = 0
    offered_per_s: float = 0.0
    """Open loop: records/s offered (--rate); 0: closed loop, and the fields below are unset."""
    p50_lower_bound: bool = False
    p99_lower_bound: bool = False
    """Batches due in the window but not sent when the load stopped make a percentile a lower bound."""
    scheduled: int = 0
    """Batches due in the window."""
    unsent: int = 0
    """Of those, not sent when the load stopped."""
    late_max_ms: float = 0.0
    late_first_ms: float = 0.0
    late_last_ms: float = 0.0
    """How far sends started behind schedule, at most: sends started in the window and batches still
    unsent when the load stopped (stop - due); over the window, its first and its last quarter."""
    interval_ms: float = 0.0
    """One client's interval between due times: clients / batches per second."""
    answer_mean_ms: float = 0.0
    answer_p99_ms: float = 0.0
    """Send to answer (without the lateness), what one client's request in flight is busy for."""
    pg_server: PgServerDelta | None = None
    """PostgreSQL: what the server did over the window (WAL written, checkpoints)."""
    writers: WriterDelta | None = None
    """What the batch writers did over the window, from the collector's /metrics (one process only)."""
    span_s: float = 0.0
    """The measured window's length, s."""
    backlog_growth: float = 0.0
    """--journal: records the writers' backlog grew by over the window (acknowledged, not committed)."""


@dataclass(frozen=True)
class PgServerDelta:
    """Server-wide counters over the window (every database's work, not only the scratch one's):
    the WAL written and the checkpoints, whose sync phase is what a commit can wait behind."""

    wal_bytes: int
    checkpoints_timed: int
    checkpoints_requested: int
    """Started because the WAL reached max_wal_size (not checkpoint_timeout)."""
    checkpoint_sync_ms: float
    max_wal_size: str


@dataclass(frozen=True)
class WriterDelta:
    """The collector's batch writers over the window (its trainvitals_ingest_group_* families):
    how busy its writer threads were, and how large and long their groups (transactions) were."""

    threads: int
    groups: int
    batches: int
    seconds: float
    """Summed over the groups: writer-thread seconds spent storing them."""
    journal_acks: int = 0
    """Batches acknowledged from the ingest journal, before their commit (--journal)."""

    def line(self, backend: str, span_s: float) -> str:
        groups = max(self.groups, 1)
        busy = self.seconds / max(self.threads * span_s, 1e-9)
        journal = f"; {self.journal_acks:,} batches acknowledged from the journal" if self.journal_acks else ""
        return (
            f"[{backend}] batch writers ({self.threads} thread{'s' if self.threads != 1 else ''}): busy {busy:.0%} "
            f"of the window, {self.batches / groups:.1f} batches a group, {1e3 * self.seconds / groups:.1f} ms a "
            f"group, {self.groups / max(span_s, 1e-9):.0f} groups/s{journal}"
        )


WRITER_SAMPLES = (
    "trainvitals_ingest_writer_threads",
    "trainvitals_ingest_group_write_duration_seconds_count",
    "trainvitals_ingest_group_write_duration_seconds_sum",
    "trainvitals_ingest_group_batches_sum",
    "trainvitals_ingest_queue_records",
    "trainvitals_ingest_journal_acks_total",  # only with an ingest journal (0 without)
)


def writer_counters(exposition: str) -> tuple[float, ...]:
    """The WRITER_SAMPLES' values in a /metrics text (a collector process's own families)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(exposition) for s in f.samples}
    optional = {"trainvitals_ingest_queue_records": 0.0, "trainvitals_ingest_journal_acks_total": 0.0}
    return tuple(values[name] if name in values or name not in optional else optional[name] for name in WRITER_SAMPLES)


def writer_delta(start: tuple[float, ...], end: tuple[float, ...]) -> WriterDelta:
    return WriterDelta(
        threads=int(end[0]),
        groups=int(end[1] - start[1]),
        batches=int(end[3] - start[3]),
        seconds=end[2] - start[2],
        journal_acks=int(end[5] - start[5]),
    )


def _scrape(base: str, token: str) -> str:
    req = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(resp.read().decode())


# The WAL position as bytes since 0/0, so that the window's WAL is a subtraction.
_PG_SERVER_COUNTERS = (
    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0'), checkpoints_timed, checkpoints_req,"
    " checkpoint_sync_time, current_setting('max_wal_size') FROM pg_stat_bgwriter"
)


def _pg_server_counters() -> tuple[Any, ...]:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        row = conn.execute(_PG_SERVER_COUNTERS).fetchone()
        assert row is not None
        return tuple(row)


def _pg_server_delta(start: tuple[Any, ...], end: tuple[Any, ...]) -> PgServerDelta:
    return PgServerDelta(
        wal_bytes=int(end[0] - start[0]),
        checkpoints_timed=int(end[1] - start[1]),
        checkpoints_requested=int(end[2] - start[2]),
        checkpoint_sync_ms=float(end[3] - start[3]),
        max_wal_size=str(end[4]),
    )


def _collector_parts_line(r: IngestResult) -> str:
    """Where the collector's CPU goes, per acknowledged record: the first place to look when ingest
    falls short of its floor (the writer near a core's worth: bound by it; the loop or the analysis
    large: they take the cores the writer needs)."""
    rate = max(r.records_per_s, 1.0)
    parts = ", ".join(f"{part} {1e6 * r.collector_parts[part] / rate:.1f}" for part in COLLECTOR_PARTS)
    cores = ", ".join(f"{r.collector_parts[part]:.2f}" for part in COLLECTOR_PARTS)
    line = f"[{r.backend}] collector CPU us/rec by part: {parts} (cores busy: {cores})"
    if r.backend == "postgresql":
        parts = ", ".join(f"{part} {1e6 * r.server_parts[part] / rate:.1f}" for part in SERVER_PARTS)
        cores = ", ".join(f"{r.server_parts[part]:.2f}" for part in SERVER_PARTS)
        line += f"\n[{r.backend}] PostgreSQL CPU us/rec by client: {parts} (cores busy: {cores})"
    return line


def _pg_server_line(r: IngestResult) -> str:
    d = r.pg_server
    assert d is not None
    wal_per_s = d.wal_bytes / max(r.span_s, 1e-9)
    checkpoints = d.checkpoints_timed + d.checkpoints_requested
    return (
        f"[{r.backend}] server (all databases): {wal_per_s / 1e6:.1f} MB/s of WAL, "
        f"{wal_per_s / max(r.records_per_s, 1.0):.0f} bytes per acknowledged record; {checkpoints} "
        f"checkpoint(s) in the window ({d.checkpoints_requested} requested by max_wal_size={d.max_wal_size}), "
        f"the sync phase of those that completed {d.checkpoint_sync_ms:.0f} ms in all"
    )


def _postgres_backends(url: str) -> dict[int, str]:
    """pid -> application_name of every backend connected to the scratch database."""
    import psycopg

    dbname = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        query = "SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s"
        rows = conn.execute(query, (dbname,)).fetchall()
    return {int(pid): name for pid, name in rows}


def _analysis_progress(url: str) -> str:
    from sqlalchemy import text

    from trainvitals.service.store.db import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            reduced = conn.execute(text("SELECT max(reduced_upto) FROM reduction_state")).scalar()
            newest = conn.execute(text("SELECT max(step) FROM steps")).scalar()
        return f"{-1 if reduced is None else reduced}/{newest}"
    finally:
        engine.dispose()


def _stored_rows(url: str) -> int:
    from sqlalchemy import text

    from trainvitals.service.store.db import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return sum(
                int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() or 0)
                for t in ("steps", "grad_stats", "tensor_stats")
            )
    finally:
        engine.dispose()


def measure(
    backend: str,
    *,
    seconds: float,
    warmup: float,
    clients: int,
    steps_per_batch: int,
    layers_per_rank: int,
    analysis: bool = True,
    analysis_thread: bool = False,
    workers: int = 1,
    port: int = 0,
    db_prefix: str = "tv_bench",
    rate: float = 0.0,
    synchronous_commit: bool = False,
    timeline: str | None = None,
    journal: bool = False,
) -> IngestResult:
    run = "bench-16k"
    with scratch_db(backend, f"{db_prefix}_ingest") as url:
        # Auth stays on, as in production: the token lookup is cached, so it costs ingest little.
        token = create_token(url, project="bench", scope="ingest")
        # Another project's read token: /metrics then holds the collector's own families and no
        # run's, so reading them costs the collector little in the window.
        scrape_token = create_token(url, project="bench-scrape", scope="read")
        env = {} if analysis else {"TRAINVITALS_RUN_ANALYSIS": "false"}
        env["TRAINVITALS_INGEST_SYNCHRONOUS_COMMIT"] = str(synchronous_commit).lower()
        extra = ("--analysis-thread",) if analysis_thread else ()
        with tempfile.TemporaryDirectory(prefix=f"{db_prefix}_journal_") as journal_dir:
            if journal:  # acknowledged once journaled (service/ingest/journal.py)
                extra = (*extra, "--ingest-journal", journal_dir)
            with collector(url, env=env, workers=workers, extra_args=extra, port=port) as col:
                return _drive(
                    analysis,
                    backend,
                    url,
                    col,
                    token,
                    run,
                    scrape_token=scrape_token if workers == 1 else None,
                    seconds=seconds,
                    warmup=warmup,
                    clients=clients,
                    steps_per_batch=steps_per_batch,
                    layers_per_rank=layers_per_rank,
                    rate=rate,
                    timeline=timeline,
                    journal=journal,
                )


def _drive(
    analysis: bool,
    backend: str,
    url: str,
    col: CollectorProcess,
    token: str,
    run: str,
    *,
    scrape_token: str | None = None,
    seconds: float,
    warmup: float,
    clients: int,
    steps_per_batch: int,
    layers_per_rank: int,
    rate: float = 0.0,
    timeline: str | None = None,
    journal: bool = False,
) -> IngestResult:
    status, body = post_json(col.base, "/v1/runs", registration(run), token)
    if status >= 300:
        raise RuntimeError(f"registration failed: {status} {body!r}")
    template, n_records = batch_template(run, 0, steps_per_batch=steps_per_batch, layers_per_rank=layers_per_rank)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    batches_per_s = rate / n_records
    # Open loop: the schedule starts just after the clients are forked (the warm-up absorbs any lag).
    schedule = (time.monotonic() + 0.5, batches_per_s) if rate > 0 else None
    procs = [
        ctx.Process(
            target=_client_main,
            args=(i, clients, col.port, run, steps_per_batch, layers_per_rank, token, stop, out, schedule),
            name=f"loadgen-{i}",
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        time.sleep(warmup)
        client_pids = [p.pid for p in procs if p.pid is not None]
        pg0 = postgres_cpu_seconds(_postgres_backends(url)) if backend == "postgresql" else {}
        collector_pids = process_tree(col.proc.pid)
        pg_server0 = _pg_server_counters() if backend == "postgresql" else None
        writers0 = writer_counters(_scrape(col.base, scrape_token)) if scrape_token else None
        cpu0 = (cpu_seconds(collector_pids), cpu_seconds(client_pids))
        threads0 = thread_cpu_seconds(collector_pids)
        t_start = time.monotonic()
        rss_peak = 0
        while time.monotonic() - t_start < seconds:
            time.sleep(0.5)
            rss_peak = max(rss_peak, sum(read_status_kb(p, "VmRSS") for p in collector_pids))
        t_end = time.monotonic()
        # Backends connected after the warm-up (pool growth) are counted from zero.
        pg1 = postgres_cpu_seconds(_postgres_backends(url)) if backend == "postgresql" else {}
        cpu1 = (cpu_seconds(collector_pids), cpu_seconds(client_pids))
        server_parts = cpu_seconds_by_part(pg0, pg1, SERVER_PARTS)
        parts = cpu_seconds_by_part(threads0, thread_cpu_seconds(collector_pids))
        pg_server1 = _pg_server_counters() if pg_server0 is not None else None
        writers1 = writer_counters(_scrape(col.base, scrape_token)) if scrape_token else None
        hwm = sum(read_status_kb(p, "VmHWM") for p in collector_pids)
        if schedule is not None:
            # Open loop: batches due at the end of the window get OPEN_LOOP_GRACE_S to be sent and
            # answered, so one still unsent at the stop is a real backlog, not an edge effect.
            time.sleep(max(0.0, t_end + OPEN_LOOP_GRACE_S - time.monotonic()))
    finally:
        t_stop = time.monotonic()
        stop.set()
        results = []
        for _ in procs:
            try:
                results.append(out.get(timeout=180))
            except Exception:  # noqa: BLE001 - a dead client must not hang the benchmark
                break
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    stored = _stored_rows(url)
    reduced = _analysis_progress(url) if analysis else "-"
    window = [s for _, samples, _, _ in results for s in samples if t_start <= s[0] < t_end]
    span = t_end - t_start
    lat = [s[1] for s in window]
    p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
    open_loop: dict[str, Any] = {}
    if schedule is not None:
        open_loop = _open_loop_stats(
            [t for *_, timed in results for t in timed], schedule, t_start, t_end, t_stop, clients
        )
        p50, p99 = open_loop.pop("p50"), open_loop.pop("p99")
        if timeline is not None:
            _write_timeline(f"{timeline}-{backend}.csv", [t for *_, timed in results for t in timed], schedule)
    # With the journal a batch is acknowledged before its commit: what the writers' backlog grew by
    # in the window was acknowledged and not stored. A closed loop's records/s (its throughput)
    # counts what was committed; an open loop's, what was acknowledged, and keeping up also needs
    # the backlog to have grown by less than a second of the rate (a batch or two in flight at
    # either scrape is not falling behind).
    backlog_growth = writers1[4] - writers0[4] if journal and writers0 and writers1 else 0.0
    acknowledged = sum(s[2] for s in window)
    return IngestResult(
        backend=backend,
        records_per_s=(acknowledged - (backlog_growth if schedule is None else 0.0)) / span,
        backlog_growth=backlog_growth,
        batches_per_s=len(window) / span,
        records_per_batch=n_records,
        body_kb=len(template) / 1024,
        p50_ms=p50 * 1e3,
        p99_ms=p99 * 1e3,
        errors=sum(e for _, _, e, _ in results),
        collector_cpu=(cpu1[0] - cpu0[0]) / span,
        collector_processes=len(collector_pids),
        collector_parts={part: seconds / span for part, seconds in parts.items()},
        postgres_cpu=sum(server_parts.values()) / span,
        server_parts={part: seconds / span for part, seconds in server_parts.items()},
        clients_cpu=(cpu1[1] - cpu0[1]) / span,
        rss_mb=rss_peak / 1024,
        hwm_mb=hwm / 1024,
        stored_rows=stored,
        reduced=reduced,
        command=col.command,
        clients=clients,
        offered_per_s=rate,
        pg_server=None if pg_server0 is None or pg_server1 is None else _pg_server_delta(pg_server0, pg_server1),
        writers=None if writers0 is None or writers1 is None else writer_delta(writers0, writers1),
        span_s=span,
        **open_loop,
    )


def _write_timeline(path: str, timed: list[tuple[int, float, float, bool]], schedule: tuple[float, float]) -> None:
    """Open loop: one CSV row per answered batch, in due order, on the wall clock (Unix seconds), to
    line a stall up with what else happened then (the server's log of its checkpoints, a profile)."""
    start, per_s = schedule
    wall = time.time() - time.monotonic()  # CLOCK_MONOTONIC is one clock for every process
    with open(path, "w") as f:
        f.write("due_unix,late_ms,answer_ms,ok\n")
        for slot, sent, done, ok in sorted(timed):
            due = start + slot / per_s
            f.write(f"{due + wall:.3f},{(sent - due) * 1e3:.1f},{(done - sent) * 1e3:.1f},{int(ok)}\n")
    print(f"timeline: {path} ({len(timed)} batches)")


def _open_loop_stats(
    timed: list[tuple[int, float, float, bool]],
    schedule: tuple[float, float],
    t_start: float,
    t_end: float,
    t_stop: float,
    clients: int,
) -> dict[str, Any]:
    """Latency over the batches DUE in [t_start, t_end), from the due time; lateness of the sends
    started in the window, and of the backlog when the load stopped.

    A batch due but never sent (its client was still behind when the load stopped at t_stop) counts
    with the lower bound t_stop - due for its latency and lateness, so a collector that falls behind
    shows a high p99 rather than a low one over the few that got through; a percentile that lands at
    or above such a lower bound is itself only a lower bound."""
    start, per_s = schedule
    first, last = math.ceil((t_start - start) * per_s), math.ceil((t_end - start) * per_s)

    def due(slot: int) -> float:
        return start + slot / per_s

    answered = {slot: (sent, done, ok) for slot, sent, done, ok in timed}
    unsent = [slot for slot in range(last) if slot not in answered]
    lat: list[tuple[float, bool]] = []  # (latency s, lower bound)
    answer: list[float] = []  # send to answer, s
    for slot in range(first, last):
        if slot in answered:
            sent, done, ok = answered[slot]
            answer.append(done - sent)
            if ok:
                lat.append((done - due(slot), False))
        else:
            lat.append((t_stop - due(slot), True))
    # (when seen, lateness s): a send started in the window; a batch still unsent at the stop.
    late = [(sent, sent - due(slot)) for slot, (sent, _, _) in answered.items() if t_start <= sent < t_end]
    late += [(t_stop, t_stop - due(slot)) for slot in unsent]
    lat.sort()
    censored = min((v for v, c in lat if c), default=math.inf)

    def pct(q: float) -> tuple[float, bool]:
        if not lat:
            return float("nan"), False
        value = lat[min(len(lat) - 1, int(q * len(lat)))][0]
        return value, value >= censored

    quarter = (t_end - t_start) / 4
    (p50, p50_lb), (p99, p99_lb) = pct(0.50), pct(0.99)
    return {
        "p50": p50,
        "p99": p99,
        "p50_lower_bound": p50_lb,
        "p99_lower_bound": p99_lb,
        "scheduled": last - first,
        "unsent": sum(1 for slot in unsent if slot >= first),
        "late_max_ms": max((v for _, v in late), default=0.0) * 1e3,
        "late_first_ms": max((v for t, v in late if t < t_start + quarter), default=0.0) * 1e3,
        "late_last_ms": max((v for t, v in late if t >= t_end - quarter), default=0.0) * 1e3,
        "interval_ms": clients / per_s * 1e3,
        "answer_mean_ms": sum(answer) / len(answer) * 1e3 if answer else float("nan"),
        "answer_p99_ms": percentile(answer, 0.99) * 1e3,
    }


# --------------------------------------------------------------------------- the raw-insert floor


FLOOR_DRIFT_WARN = 0.10
"""Floors before and after an ingest run further apart than this (relative) get a line of their own."""


@dataclass(kw_only=True, slots=True)
class FloorResult:
    backend: str
    records_per_s: float
    method: str
    client_us: float
    """CPU microseconds per record of the inserting process (its thread, during the inserts)."""
    server_us: float
    """CPU microseconds per record of its PostgreSQL backend (0 for SQLite, which runs in-process)."""


@dataclass(kw_only=True, slots=True)
class BracketedFloor:
    """The floor measured right before and right after one backend's ingest run."""

    before: FloorResult
    after: FloorResult

    @property
    def records_per_s(self) -> float:
        return (self.before.records_per_s + self.after.records_per_s) / 2

    @property
    def cpu_us(self) -> float:
        """CPU microseconds per record of the floor's inserts (process and backend), mean of the two."""
        return sum(f.client_us + f.server_us for f in (self.before, self.after)) / 2

    @property
    def low_high(self) -> tuple[float, float]:
        """The lower and the higher of the two floors, records/s."""
        low, high = sorted((self.before.records_per_s, self.after.records_per_s))
        return low, high

    @property
    def drift(self) -> float:
        """How far the two floors lie apart, relative to the lower one."""
        low, high = self.low_high
        return high / low - 1


def _floor_batches(run: str, *, steps_per_batch: int, layers_per_rank: int) -> Iterator[bytes]:
    """The load generators' batch bodies, in their order (ranks round-robin, then the next seq)."""
    templates = {}
    for key in range(TP * PP):
        template, _ = batch_template(run, key, steps_per_batch=steps_per_batch, layers_per_rank=layers_per_rank)
        templates[key] = re.split(rb"@([A-Z][0-9]*)@", template)
    seq = 0
    while True:
        for rank in range(WORLD_SIZE):
            values = {b"Q": b"%d" % seq, b"R": b"%d" % rank, b"D": b"%d" % (rank // (TP * PP))}
            for k in range(steps_per_batch):
                values[b"S%d" % k] = b"%d" % (seq * steps_per_batch + k)
                values[b"T%d" % k] = b"1712900000.000"
            parts = templates[rank % (TP * PP)]
            yield b"".join(values[p] if i % 2 else p for i, p in enumerate(parts))
        seq += 1


def _floor_write(backend: str, raw: Any, group: dict[str, list[tuple[Any, ...]]], synchronous_commit: bool) -> None:
    from trainvitals.service.store import batches as store

    if backend == "sqlite":
        cur = raw.cursor()
        cur.execute("BEGIN")
        for kind, rows in group.items():
            cur.executemany(store._SQLITE_INSERT[kind], rows)  # noqa: SLF001 - the store's own statement
    else:
        with raw.cursor() as cur:
            if not synchronous_commit:  # as the collector's ingest commits (store_batches)
                cur.execute(store.PG_ASYNC_COMMIT)
        for kind, rows in group.items():
            store.pg_copy_rows(raw, store._PG_PLAN[kind], rows)  # noqa: SLF001 - the store's own COPY
    raw.commit()


def row_tuples(built: list[dict[str, list[Any]]], skip: str = "") -> dict[str, list[tuple[Any, ...]]]:
    """The rows of several batches (`batch_rows`' flat lists) as one list of row tuples per kind, the
    kind `skip` left out: what `executemany` and COPY take."""
    from trainvitals.service.store import batches

    out: dict[str, list[tuple[Any, ...]]] = {}
    for rows in built:
        for kind, flat in rows.items():
            if kind != skip:
                width = batches._WIDTH[kind]  # noqa: SLF001 - the store's own row layout
                out.setdefault(kind, []).extend(zip(*[iter(flat)] * width, strict=True))
    return out


def measure_floor(
    backend: str,
    *,
    seconds: float,
    steps_per_batch: int,
    layers_per_rank: int,
    group_batches: int,
    db_prefix: str = "tv_bench",
    synchronous_commit: bool = False,
) -> FloorResult:
    """What the database takes from one Python process that does nothing else: the benchmark's
    records, already row tuples, into the same tables (same schema, indexes and SQLite settings),
    `group_batches` batches per transaction. SQLite: sqlite3 `executemany` per record kind;
    PostgreSQL: psycopg binary COPY per kind. No HTTP, no decoding, no idempotency rows: only the
    inserts and commits are timed. The bound that ingest's records/s is compared with."""
    from trainvitals.service.ingest.decode import decode_batch
    from trainvitals.service.store import batches as store
    from trainvitals.service.store import db
    from trainvitals.wire import RunRegistration

    run = "bench-floor"
    with scratch_db(backend, f"{db_prefix}_floor") as url:
        create_token(url, project="bench", scope="ingest")  # migrates, as for the collector
        engine = db.make_engine(url)
        try:
            with db.make_sessionmaker(engine)() as session:
                store.register_run(session, RunRegistration.model_validate(registration(run)))
            bodies = _floor_batches(run, steps_per_batch=steps_per_batch, layers_per_rank=layers_per_rank)
            total, busy = 0, 0.0
            raw = engine.raw_connection().driver_connection
            if backend == "sqlite":
                raw.isolation_level = None  # explicit BEGIN / COMMIT, one transaction per group
            backend_pid = [raw.info.backend_pid] if backend == "postgresql" else []
            client_cpu = server_cpu = 0.0
            while busy < seconds:
                built = [store.batch_rows(decode_batch(next(bodies)))[0] for _ in range(group_batches)]
                group = row_tuples(built)
                t0, c0, s0 = time.perf_counter(), time.thread_time(), cpu_seconds(backend_pid)
                _floor_write(backend, raw, group, synchronous_commit)
                busy += time.perf_counter() - t0
                client_cpu += time.thread_time() - c0
                server_cpu += cpu_seconds(backend_pid) - s0
                total += sum(map(len, group.values()))
            raw.close()
        finally:
            engine.dispose()
    commit = "synchronous_commit " + ("as the server's" if synchronous_commit else "off")
    method = "sqlite3 executemany" if backend == "sqlite" else f"psycopg binary COPY ({commit})"
    return FloorResult(
        backend=backend,
        records_per_s=total / busy,
        method=method,
        client_us=client_cpu * 1e6 / total,
        server_us=server_cpu * 1e6 / total,
    )


def _floor_drift_line(backend: str, records_per_s: float, floor: BracketedFloor) -> str | None:
    """A line when the floors before and after an ingest run lie too far apart for one ratio."""
    if floor.drift <= FLOOR_DRIFT_WARN:
        return None
    low, high = floor.low_high
    return (
        f"[{backend}] the floor moved {floor.drift:.0%} across the ingest run (the host's speed changed): "
        f"the ratio lies between {records_per_s / high:.2f} and {records_per_s / low:.2f}; rerun for a firmer one"
    )


def _ms(value: float, lower_bound: bool) -> str:
    return f"{'>' if lower_bound else ''}{value:.1f}"


def _open_loop_verdict(r: IngestResult) -> list[str]:
    """Whether the collector kept up with the offered rate, and whether the clients could."""
    ratio = r.records_per_s / r.offered_per_s
    verdict = "KEPT UP" if open_loop_kept_up(r) else "DID NOT KEEP UP: the p99 above is queueing behind a backlog"
    if r.backlog_growth > r.offered_per_s:
        behind = f"{r.backlog_growth:,.0f} records"
        verdict = f"DID NOT KEEP UP: acknowledged from the journal, but the writers fell {behind} behind"
    lines = [
        f"[{r.backend}] open loop: {r.records_per_s:,.0f} of {r.offered_per_s:,.0f} records/s offered "
        f"({ratio:.2f}); sends up to {r.late_max_ms:.1f} ms behind schedule (first quarter of the window "
        f"{r.late_first_ms:.1f} ms, last quarter {r.late_last_ms:.1f} ms); {r.unsent} of {r.scheduled} batches "
        f"due in the window not sent {OPEN_LOOP_GRACE_S:.0f} s after its end: {verdict}"
    ]
    # Little's law: batches/s x time a request is in flight = requests in flight at once, one per client.
    needed = math.ceil(r.offered_per_s / r.records_per_batch * r.answer_mean_ms / 1e3)
    answers = f"answers took {r.answer_mean_ms:.1f} ms on average (p99 {r.answer_p99_ms:.1f}) from the send"
    if needed > r.clients:
        lines.append(
            f"rate {r.offered_per_s:,.0f} needs more clients: one request in flight each, {answers}, "
            f"so keeping the schedule takes at least {needed} (have {r.clients}; a client's interval is "
            f"{r.interval_ms:.1f} ms); unless the collector is at capacity, rerun with more --clients"
        )
    elif r.late_max_ms > r.interval_ms:
        lines.append(
            f"[{r.backend}] some sends were more than a client's interval ({r.interval_ms:.1f} ms) late, though "
            f"{r.clients} clients suffice at the mean; {answers}: stalls of the collector or the shared machine"
        )
    return lines


def open_loop_kept_up(r: IngestResult) -> bool:
    """The collector acknowledged at least 97% of the offered rate, every batch due was sent, and
    (with the journal) its writers' backlog grew by less than a second of the rate."""
    return r.records_per_s / r.offered_per_s >= 0.97 and r.unsent == 0 and r.backlog_growth <= r.offered_per_s


def headline(r: IngestResult, floor: BracketedFloor | None, cores: int) -> dict[str, Any]:
    """What `--json` keeps of one backend's run: the numbers the printed tables lead with."""
    rate = max(r.records_per_s, 1.0)
    cpu = {"collector": r.collector_cpu, "postgresql": r.postgres_cpu, "load_generators": r.clients_cpu}
    us = {part: 1e6 * cores_busy / rate for part, cores_busy in cpu.items()}
    out: dict[str, Any] = {
        "backend": r.backend,
        "loop": "open" if r.offered_per_s else "closed",
        "clients": r.clients,
        "records_per_s": r.records_per_s,
        "p50_ms": r.p50_ms,
        "p99_ms": r.p99_ms,
        "p99_lower_bound": r.p99_lower_bound,
        "errors": r.errors,
        "cpu_us_per_record": us,
        "busy": sum(us.values()) * rate / 1e6 / cores,
        "reduced": r.reduced,
        "journal_acks": r.writers.journal_acks if r.writers else None,
    }
    if r.offered_per_s:
        out |= {
            "offered_per_s": r.offered_per_s,
            "kept_up": open_loop_kept_up(r),
            "unsent": r.unsent,
            "late_max_ms": r.late_max_ms,
            "answer_mean_ms": r.answer_mean_ms,
            "answer_p99_ms": r.answer_p99_ms,
        }
    if floor is not None:
        ceiling = cores * 1e6 / sum(us.values())
        out["floor"] = {
            "records_per_s_before": floor.before.records_per_s,
            "records_per_s_after": floor.after.records_per_s,
            "records_per_s": floor.records_per_s,
            "method": floor.before.method,
        }
        out["ratio_to_floor"] = r.records_per_s / floor.records_per_s
        out["cpu_ceiling_of_floor"] = ceiling / floor.records_per_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--seconds", type=float, default=40.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=6, help="load-generator processes")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: records/s offered by all clients together on a fixed schedule "
                             "(default 0: closed loop, each client sends when its last answer is back)")  # fmt: skip
    parser.add_argument("--steps-per-batch", type=int, default=4)
    parser.add_argument("--layers-per-rank", type=int, default=LAYERS // PP)
    parser.add_argument("--no-analysis", action="store_true", help="TRAINVITALS_RUN_ANALYSIS=false: ingest alone")
    parser.add_argument("--workers", type=int, default=1, help="collector processes (serve --workers N)")
    parser.add_argument(
        "--analysis-thread", action="store_true", help="serve --analysis-thread: analysis in the collector process"
    )
    parser.add_argument("--ingest-synchronous-commit", action="store_true",
                        help="PostgreSQL: TRAINVITALS_INGEST_SYNCHRONOUS_COMMIT=true, ingest and the floor "
                             "commit waiting for the WAL flush (default: synchronous_commit off, as the "
                             "collector's default)")  # fmt: skip
    parser.add_argument("--journal", action="store_true",
                        help="serve --ingest-journal (a scratch directory): batches acknowledged once journaled, "
                             "before their commit; records/s then counts records committed in the window")  # fmt: skip
    parser.add_argument("--floor-seconds", type=float, default=10.0,
                        help="insert time of the raw-insert floor before and again after each backend's ingest run "
                             "(0: no floor rows)")  # fmt: skip
    parser.add_argument("--timeline", metavar="PREFIX",
                        help="open loop: write each batch's due time (Unix s), send lateness and answer time "
                             "to PREFIX-<backend>.csv, to line stalls up with other events")  # fmt: skip
    add_shared_args(parser)
    add_json_arg(parser)
    args = parser.parse_args()
    if args.timeline and args.rate <= 0:
        parser.error("--timeline needs --rate (the open loop): a closed loop has no schedule to be late on")
    if args.rate < 0 or args.clients < 1:
        parser.error("--rate must be >= 0 and --clients >= 1")
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    mode = (
        f"open loop at {args.rate:,.0f} records/s offered with {args.clients} clients"
        if args.rate > 0
        else f"closed loop with {args.clients} clients"
    )
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"world_size {WORLD_SIZE}; {mode}; "
        f"warm-up {args.warmup:.0f} s, window {args.seconds:.0f} s; PostgreSQL ingest commits "
        + (
            "wait for the WAL flush (--ingest-synchronous-commit)\n"
            if args.ingest_synchronous_commit
            else "with synchronous_commit off (the collector's default)"
        )
        + ("; acknowledged from the ingest journal (--journal)\n" if args.journal else "\n")
    )
    results = []
    floors: dict[str, BracketedFloor] = {}
    shape = {"steps_per_batch": args.steps_per_batch, "layers_per_rank": args.layers_per_rank}

    def floor(backend: str) -> FloorResult:
        return measure_floor(
            backend,
            seconds=args.floor_seconds,
            **shape,
            group_batches=args.clients,
            db_prefix=args.db_prefix,
            synchronous_commit=args.ingest_synchronous_commit,
        )

    for backend in args.backends.split(","):
        # Right before and right after the ingest run, so that the two see the machine it saw.
        before = floor(backend) if args.floor_seconds > 0 else None
        res = measure(
            backend,
            seconds=args.seconds,
            warmup=args.warmup,
            clients=args.clients,
            **shape,
            analysis=not args.no_analysis,
            analysis_thread=args.analysis_thread,
            workers=args.workers,
            port=args.port,
            db_prefix=args.db_prefix,
            rate=args.rate,
            synchronous_commit=args.ingest_synchronous_commit,
            timeline=args.timeline,
            journal=args.journal,
        )
        print(f"[{backend}] collector ({res.collector_processes} processes): {res.command}", flush=True)
        results.append(res)
        if before is not None:
            floors[backend] = BracketedFloor(before=before, after=floor(backend))
    header = (
        f"{'backend':<11}{'offered':>10}{'records/s':>11}{'batches/s':>10}{'rec/batch':>10}{'body KB':>8}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'late ms':>8}{'errors':>7}{'CPU coll':>9}{'us/rec':>7}{'CPU pg':>7}{'CPU gen':>8}"
        f"{'RSS MB':>8}{'HWM MB':>8}{'rows stored':>13}{'reduced/newest':>16}"
    )
    print("\n" + header)
    print("-" * len(header))
    for r in results:
        offered = f"{r.offered_per_s:,.0f}" if r.offered_per_s else "closed"
        late = f"{r.late_max_ms:.1f}" if r.offered_per_s else "-"
        print(
            f"{r.backend:<11}{offered:>10}{r.records_per_s:>11,.0f}{r.batches_per_s:>10.1f}{r.records_per_batch:>10}"
            f"{r.body_kb:>8.1f}{_ms(r.p50_ms, r.p50_lower_bound):>8}{_ms(r.p99_ms, r.p99_lower_bound):>8}"
            f"{late:>8}{r.errors:>7}{r.collector_cpu:>9.2f}"
            f"{r.collector_cpu * 1e6 / max(r.records_per_s, 1):>7.1f}"
            f"{r.postgres_cpu:>7.2f}{r.clients_cpu:>8.2f}{r.rss_mb:>8.0f}{r.hwm_mb:>8.0f}"
            f"{r.stored_rows:>13,}{r.reduced:>16}"
        )
    for r in results:
        if r.offered_per_s or r.pg_server is not None:
            print()
        if r.offered_per_s:
            for line in _open_loop_verdict(r):
                print(line)
        if r.pg_server is not None:
            print(_pg_server_line(r))
    print()
    for r in results:
        print(_collector_parts_line(r))
        if r.writers is not None:  # with --workers N > 1 a scrape would see one process of N
            print(r.writers.line(r.backend, r.span_s))
    if floors:
        # Where the rest goes: the CPU each record costs on the way in (collector, PostgreSQL, load
        # generator: all on this machine's cores) against what the floor's insert costs alone. At
        # that cost the cores carry at most `ceiling` records/s: ingest near it is bound by CPU,
        # ingest well below it by waiting (round trips, the GIL, one request in flight per client).
        cores = os.cpu_count() or 1
        print(
            f"\n{'backend':<11}{'floor before':>13}{'after':>9}{'mean':>9}{'ingest rec/s':>13}{'ratio':>7}"
            f"{'floor us/rec':>13}"
            f"{'ingest us/rec':>14}{'= coll':>8}{'+ pg':>6}{'+ gen':>7}{'CPU ceiling':>12}{'of floor':>9}"
            f"{'busy':>6}  floor method"
        )
        for r in results:
            f = floors[r.backend]
            h = headline(r, f, cores)  # the CPU a record and the ceiling, as --json writes them
            us = h["cpu_us_per_record"]
            coll, pg, gen = us["collector"], us["postgresql"], us["load_generators"]
            print(
                f"{r.backend:<11}{f.before.records_per_s:>13,.0f}{f.after.records_per_s:>9,.0f}"
                f"{f.records_per_s:>9,.0f}{r.records_per_s:>13,.0f}"
                f"{h['ratio_to_floor']:>7.2f}{f.cpu_us:>13.1f}"
                f"{coll + pg + gen:>14.1f}{coll:>8.1f}{pg:>6.1f}{gen:>7.1f}"
                f"{h['cpu_ceiling_of_floor'] * f.records_per_s:>12,.0f}"
                f"{h['cpu_ceiling_of_floor']:>9.2f}{h['busy']:>6.0%}"
                f"  {f.before.method}, {args.clients} batches per commit"
            )
        print(
            f"floor: records/s of the raw inserts right before and right after the ingest run; ratio: ingest's "
            f"to their mean. floor us/rec: CPU per record of the floor's inserts (its process and, on "
            f"PostgreSQL, its backend; mean of the two). "
            f"ingest us/rec: CPU per acknowledged record in the ingest run, of the collector (all its processes), "
            f"PostgreSQL (the scratch database's backends) and the load generators. CPU ceiling: what {cores} cores "
            f"carry at that cost ({cores} x 1e6 / ingest us/rec), and its ratio to the floor; busy: the share of "
            f"the {cores} cores the ingest run kept busy (near 100%: bound by CPU; well below: by waiting)."
        )
        for r in results:
            if (line := _floor_drift_line(r.backend, r.records_per_s, floors[r.backend])) is not None:
                print(line)
    write_results(
        args.json,
        benchmark="ingest_throughput",
        command=sys.argv,
        results={"backends": [headline(r, floors.get(r.backend), os.cpu_count() or 1) for r in results]},
    )
    print(
        "\nCPU columns: cores busy on average (the collector's processes: serve, its --workers and its analysis "
        "child; PostgreSQL backends of the scratch database; all load generators); RSS and HWM: summed over the "
        "collector's processes. us/rec: the collector's CPU microseconds per acknowledged record. "
        "records/s counts acknowledged records in the window"
        + (
            " (with --journal, a closed loop's counts those committed: acknowledged, less what the writers' "
            "backlog grew by). "
            if args.journal
            else ". "
        )
        + (
            "Open loop: offered is --rate; p50/p99 run from each batch's scheduled send time to its answer, over "
            "the batches due in the window ('>': a lower bound, some were never sent); late ms: how far behind "
            "schedule a send started, at most. "
            if args.rate > 0
            else "Closed loop: p50/p99 run from send to answer, each client's next send waits for its answer. "
        )
        + "reduced/newest: the analysis worker's reduced step and the newest delivered step when the load stopped."
    )


if __name__ == "__main__":
    main()
