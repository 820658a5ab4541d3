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
