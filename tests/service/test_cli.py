"""The `trainvitals` CLI explains itself: --db mistakes, reads that create nothing, TRAINVITALS_DB,
quiet pipes, help with defaults, `token list`, `query steps`, unknown tensors and empty ranges, and
what queries print (strict JSON, CSV with headers and no formulas).

Through `main([...])`, the console script's entry point, in this process (capsys), or as the
installed `trainvitals` script where the process boundary is the point (pipes, tracebacks)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainvitals.service.cli import build_parser, main
from trainvitals.service.store import db

BIN = Path(sys.executable).parent
RUN = "r1"
STEPS = 3000  # a JSON answer of well over a pipe's buffer


def _wire_lines() -> list[str]:
    """One rank, STEPS steps with loss, tokens, flops and the job's gradient norm; peak FLOP/s
    declared so that the reduction computes MFU."""
    hardware = {"gpu_count": 1, "peak_flops": 1e15}
    reg = {"run": RUN, "project": "p", "parallelism": {"world_size": 1}, "hardware": hardware}
    lines = [json.dumps(reg)]
    for seq, first in enumerate(range(0, STEPS, 500)):
        records = [
            {"kind": "step", "step": s, "ts": 1000.0 + s, "step_seconds": 0.5, "loss": 10.0 - s / 1000,
             "tokens": 4096, "flops": 2e14, "grad_norm": 1.0 + s / 10_000}
            for s in range(first, min(first + 500, STEPS))
        ]  # fmt: skip
        lines.append(json.dumps({"run": RUN, "rank": 0, "incarnation": 1, "seq": seq, "records": records}))
    return lines


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite database holding RUN, stored and reduced by `trainvitals replay`."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "run.jsonl").write_text("\n".join(_wire_lines()) + "\n")
    url = f"sqlite:///{tmp / 'tv.db'}"
    assert main(["replay", str(tmp / "run.jsonl"), "--db", url]) == 0
    return url


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("trainvitals: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- --db mistakes


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["query", "runs", "--db", "not a url"], "cannot parse the database URL 'not a url': use sqlite:///PATH"),
        (
            ["token", "create", "--project", "p", "--scope", "read", "--db", "postgres://u:secret@127.0.0.1/tv"],
            "the database URL scheme 'postgres://' is not SQLAlchemy's: use postgresql+psycopg://u:***@127.0.0.1/tv",
        ),
        (["db", "upgrade", "--db", "postgresql+psycopg://u@h:notaport/db"], "cannot parse the database URL"),
        (["replay", "x.jsonl", "--db", "mysql://u@h/db"], "no database driver for 'mysql'"),
    ],
)
def test_a_url_mistake_is_one_line_with_the_fix(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert expected in err and "secret" not in err


def test_a_missing_directory_for_the_sqlite_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such"
    assert main(["token", "create", "--project", "p", "--scope", "read", "--db", f"sqlite:///{missing}/tv.db"]) == 2
    assert f"no directory {missing} for the SQLite file tv.db: create it (mkdir -p {missing})" in _one_line_error(
        capsys
    )
    assert not missing.exists()


@pytest.mark.parametrize("command", [["query", "runs"], ["db", "upgrade"]])
def test_a_missing_postgres_database_is_named_with_createdb(
    command: list[str], pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = pg_url.rsplit("/", 1)[0] + "/tv_no_such_database"
    assert main([*command, "--db", missing]) == 2
    err = _one_line_error(capsys)
    assert "database 'tv_no_such_database' does not exist on 127.0.0.1:5432: create it (createdb " in err


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "runs", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/tv"]) == 2
    assert "cannot reach PostgreSQL at 127.0.0.1:1" in _one_line_error(capsys)


def test_a_password_is_never_printed(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = pg_url.replace("postgres@", "postgres:pw-s3cret@")  # the test server trusts any password
    assert main(["db", "upgrade", "--db", url]) == 0
    assert main(["query", "findings", "--db", url, "--run", "nope"]) == 1
    assert main(["query", "runs", "--db", url.rsplit("/", 1)[0] + "/tv_no_such_database"]) == 2
    captured = capsys.readouterr()
    assert "pw-s3cret" not in captured.out + captured.err and "postgres:***@" in captured.out + captured.err


def test_the_installed_script_prints_no_traceback(pg_url: str, unused_port: int) -> None:
    out = subprocess.run(
        [str(BIN / "trainvitals"), "query", "runs", "--db", "postgres://u@h/db"], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "trainvitals: the database URL scheme 'postgres://' is not SQLAlchemy's: use postgresql+psycopg://u@h/db"
    )
    # serve logs its startup line first; the mistake is the last line and the exit code 2.
    missing = pg_url.rsplit("/", 1)[0] + "/tv_no_such_database"
    out = subprocess.run(
        [str(BIN / "trainvitals"), "serve", "--db", missing, "--port", str(unused_port)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].startswith("trainvitals: database 'tv_no_such_database' does not exist")


# --------------------------------------------------------------------------- reads create nothing


def test_query_never_creates_a_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "typo.db"
    for argv in (["query", "runs"], ["query", "steps", "--run", RUN], ["token", "list"], ["token", "revoke", "x"]):
        assert main([*argv, "--db", f"sqlite:///{path}"]) == 2
        assert "no SQLite database at" in _one_line_error(capsys)
        assert list(tmp_path.iterdir()) == []
    # An existing file that is not the collector's database is not given tables either.
    path.write_bytes(b"")
    assert main(["query", "runs", "--db", f"sqlite:///{path}"]) == 2
    assert "has no trainvitals tables" in _one_line_error(capsys)
    assert db.current_revision(f"sqlite:///{path}") is None


def test_query_never_creates_tables_in_postgres(empty_pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "runs", "--db", empty_pg_url]) == 2
    assert "has no trainvitals tables" in _one_line_error(capsys)
    assert db.current_revision(empty_pg_url) is None


# --------------------------------------------------------------------------- TRAINVITALS_DB


def test_every_db_flag_defers_to_the_environment() -> None:
    """No subcommand bakes a default URL into its --db: main() resolves --db, else TRAINVITALS_DB."""
    seen = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if "--db" in action.option_strings:
                seen.append(path)
                assert action.default is None, path
    assert {"serve", "analyse", "db upgrade", "token create", "token list", "query steps", "replay"} <= set(seen)


def test_trainvitals_db_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("TRAINVITALS_DB", url)
    monkeypatch.chdir(tmp_path)
    assert main(["db", "upgrade"]) == 0
    assert main(["token", "create", "--project", "p", "--scope", "read"]) == 0
    (tmp_path / "run.jsonl").write_text("\n".join(_wire_lines()[:2]) + "\n")
    assert main(["replay", str(tmp_path / "run.jsonl"), "--no-analysis"]) == 0
    capsys.readouterr()
    assert main(["token", "list"]) == 0
    assert [t["project"] for t in json.loads(capsys.readouterr().out)] == ["p"]
    assert main(["query", "runs"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [RUN]
    assert not (tmp_path / "trainvitals.db").exists()
    # --db still wins over the environment.
    assert main(["query", "runs", "--db", f"sqlite:///{tmp_path / 'other.db'}"]) == 2


# --------------------------------------------------------------------------- pipes and help


def test_piping_to_head_is_quiet(replayed: str) -> None:
    script = BIN / "trainvitals"
    out = subprocess.run(
        ["bash", "-c", f"set -o pipefail; '{script}' query steps --run {RUN} --db '{replayed}' | head -1"],
        capture_output=True,
        text=True,
    )
    assert out.stdout == "[\n" and out.stderr == "", out.stderr
    assert out.returncode in (0, 141)  # 141 when the pipe broke: what a process killed by SIGPIPE reports


def _parsers(parser: argparse.ArgumentParser, path: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _parsers(child, f"{path} {name}".strip())
    return found


def test_every_flag_has_help_showing_its_default() -> None:
    missing = []
    for path, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = formatter._expand_help(action) if action.help else ""
            if not action.help or not ("default" in text or "(required)" in text):
                missing.append(f"{path} {action.option_strings[0]}: {text!r}")
    assert not missing, missing


def test_replay_catch_up_steps_reaches_the_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--catch-up-steps N is the analysis walk's cycle (PipelineConfig.catch_up_steps); without it
    replay uses the pipeline's default, which the help names; 0 is refused."""
    from trainvitals.service.analysis.pipeline import PipelineConfig
    from trainvitals.service.ingest import replay

    seen = []
    real = replay.replay_files

    def replay_files(*args: object, config: object = None, **kwargs: object) -> object:
        seen.append(config)
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(replay, "replay_files", replay_files)
    (tmp_path / "run.jsonl").write_text("\n".join(_wire_lines()[:2]) + "\n")
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    assert main(["replay", str(tmp_path / "run.jsonl"), "--db", url, "--catch-up-steps", "300"]) == 0
    assert main(["replay", str(tmp_path / "run.jsonl"), "--db", url]) == 0
    assert [c and c.cycle_steps for c in seen] == [300, None]
    (replay_parser,) = [p for path, p in _parsers(build_parser()) if path == "replay"]
    assert f"(default: {PipelineConfig().cycle_steps}," in " ".join(replay_parser.format_help().split())
    with pytest.raises(SystemExit):
        main(["replay", "x.jsonl", "--catch-up-steps", "0"])
    assert "--catch-up-steps: must be 1 or more, not 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- token list


def test_token_list_shows_everything_but_the_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    assert main(["token", "create", "--db", url, "--project", "llm", "--scope", "ingest", "--name", "agents"]) == 0
    ingest = capsys.readouterr().out.strip()
    assert main(["token", "create", "--db", url, "--project", "other", "--scope", "read"]) == 0
    read = capsys.readouterr().out.strip()
    assert main(["token", "revoke", "--db", url, read]) == 0
    capsys.readouterr()

    assert main(["token", "list", "--db", url]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out)
    assert [(r["project"], r["scope"], r["name"], r["revoked"]) for r in rows] == [
        ("llm", "ingest", "agents", False),
        ("other", "read", None, True),
    ]
    assert all(r["created"].endswith("+00:00") for r in rows)
    assert main(["token", "list", "--db", url, "--project", "llm", "--format", "csv"]) == 0
    out += capsys.readouterr().out
    assert out.splitlines()[-2:][0] == "id,project,scope,name,created,revoked" and ",llm,ingest,agents," in out
    assert ingest not in out and read not in out and "digest" not in out


# --------------------------------------------------------------------------- token create


def test_token_create_names_the_database_and_says_when_it_created_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run in another directory, `token create` made a new ./trainvitals.db in silence: the agents'
    batches were then refused as an unknown token by the collector, which reads another database."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAINVITALS_DB", raising=False)
    create = ["token", "create", "--project", "llm", "--scope", "ingest"]
    where = (
        f"(project 'llm', scope 'ingest': shown once, stored hashed in sqlite:///{tmp_path.resolve()}/trainvitals.db"
    )
    assert main(create) == 0
    first = capsys.readouterr()
    assert first.out.count("\n") == 1 and first.out.startswith("tv_")  # stdout: the token alone, for $(...)
    assert first.err == (
        f"{where}, a new database created just now: the collector must serve this one (--db / TRAINVITALS_DB))\n"
    )
    assert main(create) == 0
    assert capsys.readouterr().err == f"{where})\n"


def test_token_create_in_postgres_names_it_without_the_password(
    empty_pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = empty_pg_url.replace("postgres@", "postgres:pw-s3cret@")  # the test server trusts any password
    for _ in range(2):
        assert main(["token", "create", "--db", url, "--project", "llm", "--scope", "read"]) == 0
    err = capsys.readouterr().err.splitlines()
    masked = url.replace("pw-s3cret", "***")
    assert err == [
        f"(project 'llm', scope 'read': shown once, stored hashed in {masked}, a new database created just now: "
        "the collector must serve this one (--db / TRAINVITALS_DB))",
        f"(project 'llm', scope 'read': shown once, stored hashed in {masked})",
    ]


# --------------------------------------------------------------------------- query steps


def test_query_steps_gives_the_history(replayed: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "steps", "--db", replayed, "--run", RUN, "--start", "1000", "--end", "1002"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1000, 1001, 1002]
    first = rows[0]
    assert first["loss"] == pytest.approx(9.0) and first["grad_norm"] == pytest.approx(1.1)
    assert first["tokens"] == 4096 and first["step_seconds_max"] == 0.5
    assert first["mfu"] == pytest.approx(2e14 / (0.5 * 1e15))

    assert main(["query", "steps", "--db", replayed, "--run", RUN, "--end", "9", "--format", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(table) == 10 and float(table[9]["loss"]) == pytest.approx(10.0 - 9 / 1000)
    assert {"step", "loss", "grad_norm", "tokens", "step_seconds_p50", "step_seconds_max", "mfu"} <= table[0].keys()


def test_an_empty_step_range_is_an_empty_answer_that_says_so(replayed: str, capsys: pytest.CaptureFixture[str]) -> None:
    have = {
        "steps": f"; the run has reduced steps 0..{STEPS - 1}",
        "step-times": f"; the run has step times for steps 0..{STEPS - 1}",
        "worst-tensors": ": the run has no FP8 tensor statistics (none sent, or none reduced yet)",
    }
    for command, line in have.items():
        assert main(["query", command, "--db", replayed, "--run", RUN, "--start", "5000", "--end", "6000"]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out) in ([], {"run": RUN, "ranks": [], "steps": [], "seconds": []})
        assert captured.err == f"trainvitals: nothing for run '{RUN}' in steps 5000..6000{line}\n"


def test_an_unknown_tensor_is_an_error(replayed: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["query", "timeline", "--db", replayed, "--run", RUN, "--tensor", "layers.9.fc"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"trainvitals: run '{RUN}' has no tensor 'layers.9.fc' (names are module names")
    assert captured.err.count("\n") == 1


def test_replay_into_another_project_and_query_by_project(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`replay --project` stores a file's runs in that project whatever its registrations name (a
    job that named the wrong one); `query --project` reads that project's run, and names what is
    missing in one line."""
    (tmp_path / "run.jsonl").write_text("\n".join(_wire_lines()[:2]) + "\n")  # registers project p
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    assert main(["replay", str(tmp_path / "run.jsonl"), "--db", url, "--no-analysis", "--project", "fixed"]) == 0
    capsys.readouterr()
    assert main(["query", "runs", "--db", url]) == 0
    assert [(r["run_id"], r["project"]) for r in json.loads(capsys.readouterr().out)] == [(RUN, "fixed")]
    assert main(["query", "checkpoints", "--db", url, "--run", RUN, "--project", "fixed"]) == 0
    capsys.readouterr()
    assert main(["query", "checkpoints", "--db", url, "--run", RUN, "--project", "p"]) == 1
    assert capsys.readouterr().err == f"trainvitals: no run {RUN!r} of project 'p' in {url}\n"


def test_serve_on_a_port_in_use_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second collector on the port (the README recipe's one still running): uvicorn found out
    after migrating and starting the analysis child, and its line named no fix (exit code 3)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["serve", "--db", f"sqlite:///{tmp_path}/tv.db", "--port", str(port), "--insecure-no-auth"])
    assert code == 2
    assert _one_line_error(capsys).rstrip("\n") == (
        f"trainvitals: 127.0.0.1:{port} is already in use (another collector? `ss -ltnp 'sport = :{port}'` shows "
        "which process): stop it, or serve on another port with --port / TRAINVITALS_PORT"
    )
    assert not (tmp_path / "tv.db").exists()  # nothing migrated, no analysis child started
    assert main(["serve", "--db", f"sqlite:///{tmp_path}/tv.db", "--host", "no-such-host.invalid"]) == 2
    assert "cannot listen on 'no-such-host.invalid' (" in _one_line_error(capsys)


def test_serve_with_an_unusable_journal_directory_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    journal = tmp_path / "a-file" / "journal"  # under a file: no directory can be made there
    code = main(
        ["serve", "--db", f"sqlite:///{tmp_path}/tv.db", "--ingest-journal", str(journal), "--insecure-no-auth"]
    )
    assert code == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"trainvitals: ingest journal directory {str(journal)!r} is not usable (")
    assert "set TRAINVITALS_INGEST_JOURNAL_DIR (--ingest-journal) to a writable directory, or leave it unset" in line
    assert not (tmp_path / "tv.db").exists()  # nothing migrated, no analysis child started


# --------------------------------------------------------------------------- settings, schema, files


def test_a_bad_setting_is_one_line_naming_the_variable(
    replayed: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pydantic's ValidationError came out as a traceback from serve, analyse and `query runs`."""
    monkeypatch.setenv("TRAINVITALS_LOG_LEVEL", "INFO")
    assert main(["serve", "--db", replayed]) == 2
    assert _one_line_error(capsys).startswith(
        "trainvitals: TRAINVITALS_LOG_LEVEL='INFO': should be 'debug', 'info', 'warning' or 'error': "
        "fix or unset TRAINVITALS_LOG_LEVEL"
    )
    monkeypatch.delenv("TRAINVITALS_LOG_LEVEL")
    # Kubernetes sets TRAINVITALS_PORT=tcp://IP:PORT for a Service named trainvitals.
    monkeypatch.setenv("TRAINVITALS_PORT", "tcp://10.96.0.12:8000")
    assert main(["serve", "--db", replayed]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("trainvitals: TRAINVITALS_PORT='tcp://10.96.0.12:8000': should be a valid integer")
    assert "Kubernetes' service link for a Service named trainvitals: pass --port" in line
    from trainvitals.service.settings import load

    assert load(port=8123).port == 8123  # the flag wins over the variable, as the line says
    monkeypatch.delenv("TRAINVITALS_PORT")
    assert main(["serve", "--db", replayed, "--port", "70000"]) == 2
    assert _one_line_error(capsys) == "trainvitals: --port=70000: should be less than or equal to 65535\n"


def test_serve_refuses_no_workers_and_query_no_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    """`--workers 0` ran one process in silence; `-k -1` listed every tensor on SQLite and was a
    traceback on PostgreSQL."""
    for argv in (["serve", "--workers", "0"], ["query", "worst-tensors", "--run", RUN, "-k", "-1"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert "must be 1 or more" in capsys.readouterr().err


def test_a_misspelt_setting_is_named_with_the_one_meant() -> None:
    from trainvitals.service.settings import misspelt_variables

    environ = {
        "TRAINVITALS_MAX_BODY_SIZE": "1",  # misspelt
        "TRAINVITALS_INSECURE_NO_AUTH": "1",  # a flag's name
        "TRAINVITALS_DATABASE_URL": "sqlite:///x.db",  # a guess
        "TRAINVITALS_DB": "sqlite:///x.db",  # a setting
        "TRAINVITALS_TOKEN": "t", "TRAINVITALS_PROJECT": "p",  # the agent's
        "TRAINVITALS_SERVICE_HOST": "10.0.0.1", "TRAINVITALS_PORT_8000_TCP": "tcp://10.0.0.1:8000",  # Kubernetes'
        "TRAINVITALS_SOMETHING_ELSE": "x",  # nothing like a setting: someone else's
    }  # fmt: skip
    assert misspelt_variables(environ) == [
        "TRAINVITALS_DATABASE_URL (did you mean TRAINVITALS_DB?)",
        "TRAINVITALS_INSECURE_NO_AUTH (did you mean TRAINVITALS_AUTH=false?)",
        "TRAINVITALS_MAX_BODY_SIZE (did you mean TRAINVITALS_MAX_BODY_BYTES?)",
    ]


def test_the_agent_variables_left_out_are_the_agents() -> None:
    """settings._NOT_SETTINGS names the agent's variables by hand (the collector does not import the
    agent, which imports torch): a variable the agent adds must not be warned about."""
    import re

    from trainvitals.service import settings

    agent_config = (Path(__file__).parents[2] / "agent" / "_config.py").read_text()
    assert set(re.findall(r"TRAINVITALS_[A-Z_]+", agent_config)) <= settings._NOT_SETTINGS


def test_replay_of_a_missing_file_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A glob that matched nothing reaches replay as itself: the line says so, and where spools are."""
    assert main(["replay", str(tmp_path / "spool" / "*.jsonl"), "--db", f"sqlite:///{tmp_path}/tv.db"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(
        f"trainvitals: no file '{tmp_path}/spool/*.jsonl' (a pattern that matched no file): replay takes"
    )
    assert "spools are <run>.rank<r>.jsonl on the node that ran it, in ${TMPDIR:-/tmp}/trainvitals-spool-$USER/" in err
    assert not (tmp_path / "tv.db").exists()


def test_a_database_on_another_schema_revision_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An older database failed on the first missing column (a wrong fix on SQLite, a traceback on
    PostgreSQL); one migrated by a newer trainvitals, and a misspelt --revision, were tracebacks."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url, "0016")
    assert main(["query", "runs", "--db", url]) == 2
    assert _one_line_error(capsys) == (
        f"trainvitals: sqlite:///{tmp_path}/tv.db: the database is at schema revision 0016, this trainvitals reads "
        "0022: migrate it with `trainvitals db upgrade --db URL` (serve does so when it starts)\n"
    )
    assert main(["db", "upgrade", "--db", url, "--revision", "nope"]) == 2
    assert "Can't locate revision identified by 'nope': revisions are head, base, +N/-N or 0001..0022" in (
        _one_line_error(capsys)
    )
    import sqlite3

    with sqlite3.connect(tmp_path / "tv.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0042'")
    newer = "the database is at schema revision '0042', which this trainvitals (schema 0022) does not know"
    for argv in (["query", "runs", "--db", url], ["db", "upgrade", "--db", url]):
        assert main(argv) == 2
        assert newer in _one_line_error(capsys), argv


def test_dashboards_without_the_extra_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in [m for m in sys.modules if m.startswith(("trainvitals.dashboards", "grafana_foundation_sdk"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "grafana_foundation_sdk", None)  # as if not installed
    assert main(["dashboards", "write", str(tmp_path)]) == 2
    assert _one_line_error(capsys) == (
        "trainvitals: dashboards need the grafana-foundation-sdk: pip install 'trainvitals[dashboards]'\n"
    )


def test_a_reversed_or_too_large_range_is_said(
    replayed: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["query", "steps", "--db", replayed, "--run", RUN, "--start", "500", "--end", "100"]) == 2
    assert _one_line_error(capsys) == "trainvitals: --start 500 is after --end 100: need start <= end\n"
    from trainvitals.service.store import queries

    monkeypatch.setattr(queries.step_history, "__kwdefaults__", {"limit": 100})
    assert main(["query", "steps", "--db", replayed, "--run", RUN, "--start", "0", "--end", "100"]) == 1
    assert _one_line_error(capsys) == (
        "trainvitals: steps 0..100 hold more than 100 steps, the most one answer holds: ask for a shorter step "
        "range (--start/--end)\n"
    )
    assert main(["query", "steps", "--db", replayed, "--run", RUN, "--start", "0", "--end", "99"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 100


# --------------------------------------------------------------------------- db upgrade / downgrade


def test_a_refused_downgrade_is_one_line_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0016's downgrade refuses when two projects share a run id: that was a traceback."""
    from sqlalchemy import text

    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    with engine.begin() as conn:
        for key, project in (("d1", "default"), ("b/d1", "b")):
            conn.execute(
                text("INSERT INTO runs (run_id, project, registration, world_size, status, created_at, last_seen_at) "
                     f"VALUES ('{key}', '{project}', '{{}}', 1, 'running', 1.0, 1.0)")
            )  # fmt: skip
    engine.dispose()
    assert main(["db", "downgrade", "--db", url, "--revision", "0015"]) == 2
    assert _one_line_error(capsys) == (
        "trainvitals: run id 'd1' is used by two projects: delete or rename one before downgrading\n"
    )
    assert db.current_revision(url) == db._revisions()[1]  # 0018's and 0017's downgrades rolled back too


def test_downgrade_needs_a_revision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --revision it went to base: every table dropped, without a word."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    with pytest.raises(SystemExit) as exited:
        main(["db", "downgrade", "--db", url])
    assert exited.value.code == 2
    assert "the following arguments are required: --revision" in capsys.readouterr().err
    assert db.current_revision(url) == db._revisions()[1]


def test_db_upgrade_says_which_way_to_go(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`db upgrade --revision 0005` on a database at 0010 did nothing and exited 0."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url, "0010")
    assert main(["db", "upgrade", "--db", url, "--revision", "0005"]) == 2
    assert _one_line_error(capsys) == (
        "trainvitals: the database is at schema revision 0010, past 0005: `db upgrade` only moves forward; "
        "to go back, `trainvitals db downgrade --revision 0005 --db URL`\n"
    )
    assert main(["db", "downgrade", "--db", url, "--revision", "0018"]) == 2
    assert "at schema revision 0010, before 0018: `db downgrade` only moves back" in _one_line_error(capsys)
    assert db.current_revision(url) == "0010"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_tables_without_a_revision_are_named_so(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """trainvitals' tables without alembic_version (create_all, a restored dump): `db upgrade` said
    "table checkpoints already exists (is the file a database, writable?)" on SQLite and was a
    traceback on PostgreSQL; `query runs` said the database had no trainvitals tables."""
    from trainvitals.service.store.models import Base

    url = f"sqlite:///{tmp_path}/tv.db" if backend == "sqlite" else request.getfixturevalue("empty_pg_url")
    engine = db.make_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    line = (
        "the database has tables named as trainvitals' (analysis_status, api_tokens, batches, ...) but no schema "
        "revision (no alembic_version row): `trainvitals db upgrade` did not create them; point --db / "
        "TRAINVITALS_DB at the collector's database or at an empty one\n"
    )
    for argv in (["db", "upgrade"], ["query", "runs"]):
        assert main([*argv, "--db", url]) == 2
        assert line in _one_line_error(capsys), argv


def test_another_applications_alembic_version_is_named_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another application's Alembic revision read as "a newer trainvitals migrated it"."""
    import sqlite3

    with sqlite3.connect(tmp_path / "tv.db") as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('ae1027a6acf')")
    line = (
        "the database's alembic_version holds revision 'ae1027a6acf', not one of trainvitals' (0001..0022): "
        "another application migrated it; give trainvitals a database of its own\n"
    )
    for argv in (["db", "upgrade"], ["query", "runs"]):
        assert main([*argv, "--db", f"sqlite:///{tmp_path}/tv.db"]) == 2
        assert line in _one_line_error(capsys), argv


# --------------------------------------------------------------------------- what query prints

FORMULA = '=HYPERLINK("http://evil.example","click")'  # a spreadsheet runs it when the CSV is opened
ODD = "r2"


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite database with run ODD of project FORMULA: a non-finite gradient norm (step 5) and
    loss (step 6), FP8 statistics of a tensor named FORMULA (input, clipping at step 10) and of
    layers.0.fc (weight, an overflowed amax at step 20)."""
    tmp = tmp_path_factory.mktemp("odd")
    steps = [
        {"kind": "step", "step": s, "ts": 1000.0 + s, "step_seconds": 0.5,
         "loss": float("nan") if s == 6 else 2.0, "grad_norm": float("inf") if s == 5 else 1.0}
        for s in range(40)
    ]  # fmt: skip
    tensors = [
        {"kind": "tensor", "step": s, "tensor": FORMULA, "role": "input", "format": "e4m3", "amax": 1.0,
         "headroom_bits": -1.5 if s == 10 else 2.0}
        for s in (0, 10, 20, 30)
    ] + [
        {"kind": "tensor", "step": s, "tensor": "layers.0.fc", "role": "weight", "format": "e4m3",
         "amax": float("inf") if s == 20 else 1.0, "headroom_bits": 3.0, "nonfinite": 7 if s == 20 else 0}
        for s in (0, 10, 20, 30)
    ]  # fmt: skip
    reg = {"run": ODD, "project": FORMULA, "parallelism": {"world_size": 1}}
    batch = {"run": ODD, "rank": 0, "incarnation": 1, "seq": 0, "records": steps + tensors}
    (tmp / "odd.jsonl").write_text(json.dumps(reg) + "\n" + json.dumps(batch) + "\n")  # NaN/Infinity constants
    url = f"sqlite:///{tmp / 'tv.db'}"
    assert main(["replay", str(tmp / "odd.jsonl"), "--db", url]) == 0
    return url


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_query_json_is_strict_and_keeps_the_nonfinite_counts(odd: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Python's json printed Infinity and NaN, which jq and every strict parser refuse."""
    capsys.readouterr()
    assert main(["query", "steps", "--db", odd, "--run", ODD, "--start", "5", "--end", "6"]) == 0
    rows = _strict_json(capsys.readouterr().out)
    assert [(r["grad_norm"], r["grad_nonfinite"], r["loss"], r["loss_nonfinite"]) for r in rows] == [
        (None, 1, 2.0, 0),
        (1.0, 0, None, 1),
    ]
    assert main(["query", "timeline", "--db", odd, "--run", ODD, "--tensor", "layers.0.fc", "--start", "20"]) == 0
    first = _strict_json(capsys.readouterr().out)[0]  # type: ignore[index]
    assert (first["step"], first["amax"], first["nonfinite"]) == (20, None, 7)
    for command in (["runs"], ["worst-tensors", "--run", ODD], ["analysis", "--run", ODD], ["findings", "--run", ODD]):
        assert main(["query", *command, "--db", odd]) == 0
        _strict_json(capsys.readouterr().out)


def test_query_csv_runs_no_formula(odd: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor or project named like a formula ran as one in the spreadsheet that opened the CSV."""
    capsys.readouterr()
    assert main(["query", "worst-tensors", "--db", odd, "--run", ODD, "--format", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["tensor"], r["min_headroom_bits"], r["clipped_steps"]) for r in table] == [
        ("'" + FORMULA, "-1.5", "1"),
        ("layers.0.fc", "3.0", "0"),
    ]
    assert main(["query", "runs", "--db", odd, "--format", "csv"]) == 0
    assert [r["project"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))] == ["'" + FORMULA]
    assert main(["query", "timeline", "--db", odd, "--run", ODD, "--tensor", "layers.0.fc", "--format", "csv"]) == 0
    rows = {r["step"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert (rows["20"]["amax"], rows["20"]["nonfinite"], rows["20"]["shadow"]) == ("", "7", "false")


@pytest.mark.parametrize(
    ("command", "model"),
    [
        (["steps", "--start", "5000"], None),
        (["worst-tensors"], "WorstTensorPublic"),
        (["findings", "--active"], "FindingPublic"),
        (["checkpoints"], "CheckpointGenerationPublic"),
    ],
)
def test_an_empty_csv_answer_is_its_header(
    replayed: str, command: list[str], model: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty answer printed a blank line, where a script expects the header to read."""
    from trainvitals.service.api import schemas
    from trainvitals.service.store.queries import STEP_HISTORY_COLUMNS

    capsys.readouterr()
    assert main(["query", command[0], "--db", replayed, "--run", RUN, *command[1:], "--format", "csv"]) == 0
    columns = list(STEP_HISTORY_COLUMNS) if model is None else list(getattr(schemas, model).model_fields)
    assert capsys.readouterr().out == ",".join(columns) + "\n"


def test_empty_runs_and_tokens_are_their_headers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    db.upgrade(url)
    assert main(["query", "runs", "--db", url, "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("run_id,project,status,world_size,ranks,steps,")
    assert main(["token", "list", "--db", url, "--format", "csv"]) == 0
    assert capsys.readouterr().out == "id,project,scope,name,created,revoked\n"
    assert main(["token", "revoke", "tv_nosuchtoken", "--db", url]) == 1
    assert _one_line_error(capsys).startswith("trainvitals: no such token in ")


def test_query_runs_reads_only_the_warmup_setting(
    replayed: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`query runs` read every setting: in a pod of a namespace with a Service named trainvitals
    it failed on TRAINVITALS_PORT=tcp://... and advised --port, a flag query does not have."""
    capsys.readouterr()
    monkeypatch.setenv("TRAINVITALS_PORT", "tcp://10.96.0.12:8000")
    monkeypatch.setenv("TRAINVITALS_LOG_LEVEL", "INFO")
    monkeypatch.setenv("TRAINVITALS_DETECTOR_WARMUP_STEPS", "7")
    assert main(["query", "runs", "--db", replayed]) == 0
    assert json.loads(capsys.readouterr().out)[0]["detector_warmup_steps"] == 7
    monkeypatch.setenv("TRAINVITALS_DETECTOR_WARMUP_STEPS", "-1")
    assert main(["query", "runs", "--db", replayed]) == 2
    assert _one_line_error(capsys) == (
        "trainvitals: TRAINVITALS_DETECTOR_WARMUP_STEPS='-1': should be greater than or equal to 0: "
        "fix or unset TRAINVITALS_DETECTOR_WARMUP_STEPS\n"
    )


def test_nothing_found_names_what_is_missing(replayed: str, odd: str, capsys: pytest.CaptureFixture[str]) -> None:
    """worst-tensors of a run without FP8 statistics, and a timeline of a role the tensor lacks,
    said "nothing in any step; the run has reduced steps 0..N", as if the range were the cause."""
    capsys.readouterr()
    assert main(["query", "worst-tensors", "--db", replayed, "--run", RUN]) == 0
    assert capsys.readouterr().err == (
        f"trainvitals: nothing for run '{RUN}' in any step: the run has no FP8 tensor statistics "
        "(none sent, or none reduced yet)\n"
    )
    argv = ["query", "timeline", "--db", odd, "--run", ODD, "--tensor", "layers.0.fc", "--role", "input"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"trainvitals: run '{ODD}': tensor 'layers.0.fc' has roles weight, not input: pass one of them to --role, "
        "or leave --role out\n"
    )
    assert main([*argv[:-1], "weight", "--start", "31"]) == 0
    assert capsys.readouterr().err == (
        f"trainvitals: nothing for run '{ODD}', tensor 'layers.0.fc' (weight) in steps 31..; the tensor has FP8 "
        "statistics for steps 0..30\n"
    )
    assert main(["query", "worst-tensors", "--db", odd, "--run", ODD, "--start", "31"]) == 0
    assert capsys.readouterr().err == (
        f"trainvitals: nothing for run '{ODD}' in steps 31..; the run has FP8 statistics for steps 0..30\n"
    )


def test_step_times_quote_the_steps_they_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """step-times read the ranks' stored step times, not the reduced steps: stored but not yet
    reduced, it said "no step of the run is reduced yet" of steps it could show."""
    (tmp_path / "run.jsonl").write_text("\n".join(_wire_lines()[:2]) + "\n")  # steps 0..499
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    assert main(["replay", str(tmp_path / "run.jsonl"), "--db", url, "--no-analysis"]) == 0
    capsys.readouterr()
    assert main(["query", "step-times", "--db", url, "--run", RUN, "--start", "600", "--end", "700"]) == 0
    assert capsys.readouterr().err == (
        f"trainvitals: nothing for run '{RUN}' in steps 600..700; the run has step times for steps 0..499\n"
    )
    assert main(["query", "steps", "--db", url, "--run", RUN, "--start", "600", "--end", "700"]) == 0
    assert capsys.readouterr().err == (
        f"trainvitals: nothing for run '{RUN}' in steps 600..700: no step of the run is reduced yet\n"
    )


def test_without_project_query_reads_the_default_projects_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--project's help said "the one run with that id in any project", but the default project's
    run of that id comes first (store/run_keys.py), as docs/cli.md says."""
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    for project in ("default", "other"):
        (tmp_path / "run.jsonl").write_text("\n".join(_wire_lines()[:2]) + "\n")
        assert main(["replay", str(tmp_path / "run.jsonl"), "--db", url, "--no-analysis", "--project", project]) == 0
    capsys.readouterr()
    assert main(["query", "checkpoints", "--db", url, "--run", RUN]) == 0  # not ambiguous: the default one
    with pytest.raises(SystemExit):
        main(["query", "checkpoints", "--help"])
    assert "the `default` project's run of that id, else the one run with that id in any project" in " ".join(
        capsys.readouterr().out.split()
    )
