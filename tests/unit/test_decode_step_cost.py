"""scripts/decode_step_cost.py's pure parts: a mode with its engines' environment.

The script starts real clusters; its figures are docs/benchmarks.md's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import decode_step_cost  # noqa: E402


def test_a_mode_may_carry_settings_for_its_engines() -> None:
    assert decode_step_cost.split_mode("turnkv") == ("turnkv", {})
    assert decode_step_cost.split_mode("turnkv@UCX_MEM_EVENTS=n@A=b=c") == (
        "turnkv", {"UCX_MEM_EVENTS": "n", "A": "b=c"})


def test_the_engines_environment_is_restored_after_the_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNKV_TEST_KEPT", "before")
    monkeypatch.delenv("TURNKV_TEST_NEW", raising=False)
    with decode_step_cost.environment({"TURNKV_TEST_KEPT": "during", "TURNKV_TEST_NEW": "x"}):
        assert os.environ["TURNKV_TEST_KEPT"] == "during"
        assert os.environ["TURNKV_TEST_NEW"] == "x"
    assert os.environ["TURNKV_TEST_KEPT"] == "before"
    assert "TURNKV_TEST_NEW" not in os.environ
