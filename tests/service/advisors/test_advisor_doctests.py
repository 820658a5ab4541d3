"""The usage examples in the advisor modules' docstrings run and hold."""

import doctest
import importlib

import pytest

MODULES = ["", ".cadence", ".cost_model", ".failure_log", ".hardware", ".memory", ".model_config",
           ".recommend", ".simulator"]


@pytest.mark.parametrize("suffix", MODULES)
def test_docstring_examples(suffix: str) -> None:
    module = importlib.import_module("trainvitals.service.advisors" + suffix)
    result = doctest.testmod(module)
    assert result.failed == 0
