"""A regular (non-editable) `pip install .` works: the folder -> trainvitals.* mapping, the
migrations and the console script all land in site-packages."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_runs_from_site_packages(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next((tmp_path / "dist").glob("trainvitals-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Reuse this environment's dependencies (torch, fastapi, ...) without its editable trainvitals:
    # a plain path entry in a .pth file does not process that directory's own .pth files.
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True
    )
    code = (
        "import trainvitals.agent, trainvitals.service.main, trainvitals.wire,"
        " trainvitals.examples.train_gpt,"
        " trainvitals.migrations, sys; print(trainvitals.agent.__file__)"
    )
    where = subprocess.check_output([str(venv / "bin" / "python"), "-c", code], text=True, cwd=tmp_path)
    assert str(site) in where, where
    db_url = f"sqlite:///{tmp_path / 'x.db'}"
    out = subprocess.check_output(
        [str(venv / "bin" / "trainvitals"), "db", "upgrade", "--db", db_url], text=True, cwd=tmp_path
    )
    from alembic.script import ScriptDirectory

    from trainvitals.service.store.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    assert f"at revision {head}" in out
