"""scripts/tier_copy_rate.py on a small shape: it runs and writes a row per block count.

The script's figures are docs/tier.md's; here it only has to keep running (its copier is
`tier.host_copy`'s, whose bytes tests/unit/test_tier_host_copy.py checks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import tier_copy_rate  # noqa: E402


def test_the_copy_rate_script_writes_a_row_per_block_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "rate.json"
    monkeypatch.setattr(sys, "argv", ["tier_copy_rate.py", "--layers", "2", "--page-bytes",
                                      "4096", "--repeats", "1", "--json", str(out)])
    tier_copy_rate.main()
    result = json.loads(out.read_text())
    assert result["block_bytes"] == 2 * 4096
    assert [row["blocks"] for row in result["rows"]] == list(tier_copy_rate.BLOCK_COUNTS)
    assert all(row["store_ms_per_block"] > 0 and row["load_ms_per_block"] > 0
               for row in result["rows"])
