"""AgentConfig: where the spool goes by default, and what overrides it."""

import getpass
import tempfile
from pathlib import Path

import pytest

from trainvitals.agent import AgentConfig


def test_default_spool_is_node_local_and_per_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINVITALS_SPILL_DIR", raising=False)
    spill = Path(str(AgentConfig(collector="").spill_dir))
    assert spill.parent == Path(tempfile.gettempdir())  # TMPDIR when set, else /tmp: not the cwd
    assert spill.name == f"trainvitals-spool-{getpass.getuser()}"


def test_environment_and_field_override_the_spool_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINVITALS_SPILL_DIR", str(tmp_path / "env"))
    assert AgentConfig(collector="").spill_dir == str(tmp_path / "env")
    assert AgentConfig(collector="", spill_dir=str(tmp_path / "field")).spill_dir == str(tmp_path / "field")


@pytest.mark.parametrize(
    ("env", "argument", "registered"),
    [
        (None, None, None),  # none named: the collector takes the token's project
        ("llm", None, "llm"),  # TRAINVITALS_PROJECT
        ("llm", "vision", "vision"),  # attach(project=...) wins
    ],
)
def test_the_registrations_project(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: str | None, argument: str | None, registered: str | None
) -> None:
    import json

    import trainvitals.agent as tv

    if env is None:
        monkeypatch.delenv("TRAINVITALS_PROJECT", raising=False)
    else:
        monkeypatch.setenv("TRAINVITALS_PROJECT", env)
    record = tmp_path / "record.jsonl"
    config = AgentConfig(collector="", spill_dir=str(tmp_path), record_file=str(record))
    agent = tv.attach(run="r1", project=argument, config=config)
    agent.close()
    assert json.loads(record.read_bytes().splitlines()[0]).get("project") == registered
