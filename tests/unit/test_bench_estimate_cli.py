"""`turnkv estimate`'s options: measurements replace assumptions, bad values fail clearly."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from turnkv_server.bench import estimate as est
from turnkv_server.bench.estimate_cli import (
    EstimateOptions,
    cluster_for,
    parse_measured_prefill,
    run_estimate,
    turns_for,
)
from turnkv_server.bench.plan import PlanError


def test_measured_prefill_sets_the_mfu_that_reproduces_it() -> None:
    model, cluster, sources = cluster_for(EstimateOptions(measured_prefill="8000:400"))
    assert est.prefill_ms(model, cluster, 0, 8000) == pytest.approx(400.0)
    assert cluster.mfu != est.h200_efa(est.H200_BF16_FLOPS).mfu
    assert "measured prefill" in sources[0]


def test_measured_link_replaces_rate_and_efficiency() -> None:
    model, cluster, _ = cluster_for(EstimateOptions(link_gbps=800.0))
    # 800 Gbit/s = 100 GB/s: 1,000 tokens of 256 KiB in 2.62 ms.
    assert est.transfer_ms(model, cluster, 1000) == pytest.approx(1000 * 262144 / 1e8)


@pytest.mark.parametrize("text", ["8000", "a:b", "0:10", "100:-1", "1:2:3"])
def test_bad_measured_prefill_is_a_plan_error(text: str) -> None:
    with pytest.raises(PlanError, match="measured-prefill"):
        parse_measured_prefill(text)


@pytest.mark.parametrize("options", [
    EstimateOptions(model="llama-405b"), EstimateOptions(mfu=1.5),
    EstimateOptions(link_efficiency=0.0), EstimateOptions(link_gbps=-1.0),
    EstimateOptions(workload="nope"), EstimateOptions(workload="agent", context=9000),
    EstimateOptions(context=100),
])
def test_bad_options_are_plan_errors(options: EstimateOptions) -> None:
    with pytest.raises(PlanError):
        cluster_for(options)
        turns_for(options)


def test_blog_turns_end_at_the_published_context() -> None:
    for model, context in (("qwen3-32b", 24_000), ("glm-5", 20_000)):
        rows = est.estimate(*cluster_for(EstimateOptions(model=model))[:2],
                            turns_for(EstimateOptions(model=model)))
        assert rows[-1].prompt_tokens == context


def test_preset_turns_follow_its_longest_session() -> None:
    turns = turns_for(EstimateOptions(workload="conversation"))
    assert len(turns) == 8 and all(t.output_tokens == 64 for t in turns)
    assert turns[0].new_tokens > turns[1].new_tokens  # the first carries the system prompt


def test_json_is_labelled_an_estimate(tmp_path: Path) -> None:
    path = tmp_path / "est.json"
    run_estimate(EstimateOptions(json_out=path), Console(file=io.StringIO()))
    data = json.loads(path.read_text())
    assert data["label"].startswith("ESTIMATE")
    assert len(data["turns"]) == 10 and data["median_speedup_after_turn_1"]["standard-nocache"] == 1
