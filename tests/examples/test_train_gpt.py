"""The example's flags: a fault flag that would do nothing is refused in one line."""

from __future__ import annotations

import pytest

from trainvitals.examples.train_gpt import parse_args


@pytest.mark.parametrize("argv", [["--crash-rank", "1"], ["--crash-at", "30"]])
def test_a_crash_flag_alone_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--crash-rank without --crash-at (README listed it alone) crashed nothing, in silence."""
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert "error: --crash-rank and --crash-at go together: --crash-rank R --crash-at S" in capsys.readouterr().err


def test_both_crash_flags_are_taken() -> None:
    args = parse_args(["--crash-rank", "1", "--crash-at", "30"])
    assert (args.crash_rank, args.crash_at) == (1, 30)


def test_a_send_interval_of_zero_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--send-interval", "0"])
    assert "--send-interval must be > 0 seconds, not 0" in capsys.readouterr().err
