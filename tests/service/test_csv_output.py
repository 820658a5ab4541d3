"""CSV cells hold what the JSON answer holds, and no formula a spreadsheet would run."""

import csv
import io

import pytest

from trainvitals.service.csv_output import to_csv

FORMULAS = ['=HYPERLINK("http://evil.example","x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\t=1", "\r=1"]


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


@pytest.mark.parametrize("text", FORMULAS)
def test_text_a_spreadsheet_would_run_starts_with_a_quote(text: str) -> None:
    rows = _rows(to_csv([{"tensor": text, "error": text}]))
    assert rows[1] == ["'" + text, "'" + text]
    assert _rows(to_csv({"message": text}))[1] == ["message", "'" + text]


def test_numbers_stay_numbers_and_other_text_stays_as_it_is() -> None:
    rows = _rows(to_csv([{"headroom_bits": -1.5, "clipped": -3, "tensor": "layers.0.fc", "note": "a=b"}]))
    assert rows[1] == ["-1.5", "-3", "layers.0.fc", "a=b"]
    matrix = {"run": "r", "ranks": [0, 1], "steps": [7], "seconds": [[-0.0, None]]}
    assert _rows(to_csv(matrix)) == [["step", "rank0", "rank1"], ["7", "-0.0", ""]]


def test_null_and_non_finite_are_empty_and_booleans_as_in_json() -> None:
    row = {"amax": float("inf"), "headroom": float("-inf"), "loss": float("nan"), "sat": None,
           "shadow": True, "revoked": False, "evidence": {"z": float("inf"), "n": 1}}  # fmt: skip
    assert _rows(to_csv([row]))[1] == ["", "", "", "", "true", "false", '{"z": null, "n": 1}']
    matrix = {"run": "r", "ranks": [0], "steps": [1], "seconds": [[float("inf")]]}
    assert _rows(to_csv(matrix))[1] == ["1", ""]


def test_no_rows_still_give_the_header() -> None:
    assert to_csv([], columns=("step", "loss")) == "step,loss\n"
    assert to_csv([{"step": 1, "loss": 2.0, "extra": 3}], columns=("step", "loss")) == "step,loss,extra\n1,2.0,3\n"


def test_a_line_break_in_text_stays_in_its_cell() -> None:
    """csv.writer left a field holding a CR (and no LF) unquoted: a progress bar's CR split the row."""
    error = "saving 10%\rsaving 100%\rOSError: disk full"
    assert _rows(to_csv([{"error": error, "step": 3}])) == [["error", "step"], [error, "3"]]
