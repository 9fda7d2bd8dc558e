"""The scale estimate's arithmetic, on a hand-computed case, and its monotonic behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from turnkv_server.bench.estimate import (
    ESTIMATE_LABEL,
    GLM5,
    MODES,
    PUBLISHED,
    QWEN3_32B,
    Knob,
    ModelShape,
    NodePair,
    TurnShape,
    blog_workload,
    calibrate,
    estimate,
    implied_mfu,
    overlapped_ms,
    prefill_flops,
    prefill_ms,
    published_estimates,
    published_scenarios,
    sum_keys,
    turn_ttft_ms,
    typical_speedup,
)
from turnkv_server.bench.report import estimate_summary_markdown, estimate_turns_markdown

# 1e12 FLOPs and 1 MB of KV per token, no attention term; 1e15 FLOP/s and 1 GB/s: so 1 ms of
# prefill and 1 ms of transfer per token, which makes every figure below countable by hand.
TOY = ModelShape(name="toy", active_params=0.5e12, layers=10, attn_heads=0, qk_head_dim=1,
                 v_head_dim=1, kv_bytes_per_token=1_000_000)
TOY_CLUSTER = NodePair(name="toy", gpus_per_instance=1, peak_flops_per_gpu=1e15, mfu=1.0,
                      link_bytes_per_s=1e9, link_efficiency=1.0, fixed_ms=5.0)


def test_hand_computed_turn() -> None:
    # 110 prompt tokens: 100 of history (90 of them the previous prompt), 10 new.
    ttft = turn_ttft_ms(TOY, TOY_CLUSTER, prompt=110, history=100, cached_prompt=90)
    assert ttft["standard-nocache"] == pytest.approx(5 + 110 + 110)
    assert ttft["standard"] == pytest.approx(5 + 20 + 110)
    assert ttft["bidirectional"] == pytest.approx(5 + 100 + 10 + 10)
    # 10 ms compute and 10 ms transfer over 10 layers: 10 + 10 / 10.
    assert ttft["turnkv"] == pytest.approx(5 + 11)


def test_session_bookkeeping() -> None:
    rows = estimate(TOY, TOY_CLUSTER, [TurnShape(100, 20), TurnShape(10, 5)])
    assert [(r.prompt_tokens, r.history_tokens) for r in rows] == [(100, 0), (130, 120)]
    assert rows[1].ttft_ms == turn_ttft_ms(TOY, TOY_CLUSTER, 130, 120, 100)
    assert rows[1].speedup_vs_baseline["standard-nocache"] == 1.0
    assert rows[1].speedup_vs_baseline["turnkv"] == pytest.approx((5 + 260) / (5 + 10 + 1))


def test_sum_keys_and_attention_flops() -> None:
    assert sum_keys(0, 5) == 0 + 1 + 2 + 3 + 4
    assert sum_keys(2, 5) == 2 + 3 + 4
    assert sum_keys(0, 5, window=3) == 0 + 1 + 2 + 3 + 3
    assert sum_keys(4, 6, window=3) == 3 + 3
    assert sum_keys(5, 5) == 0
    attn = dataclasses.replace(TOY, attn_heads=1)  # 2 x 10 layers x 1 head x (1 + 1) per key
    assert prefill_flops(attn, 0, 3) == pytest.approx(3e12 + 40 * (0 + 1 + 2))


def test_overlap_pipeline() -> None:
    assert overlapped_ms(100.0, 20.0, 10) == pytest.approx(102.0)
    assert overlapped_ms(20.0, 100.0, 10) == pytest.approx(102.0)


def test_published_kv_sizes() -> None:
    assert QWEN3_32B.kv_bytes_per_token == 256 * 1024
    assert GLM5.kv_bytes_per_token == 78 * 788


@pytest.mark.parametrize("model", [QWEN3_32B, GLM5])
def test_longer_history_bigger_gain(model: ModelShape) -> None:
    _, _, cluster = published_scenarios()[0]
    rows = estimate(model, cluster, blog_workload(24_000))
    gains = [r.speedup_vs_baseline["turnkv"] for r in rows[1:]]
    assert gains == sorted(gains) and gains[-1] > gains[0]
    short = typical_speedup(estimate(model, cluster, blog_workload(8_000)), "turnkv")
    long = typical_speedup(estimate(model, cluster, blog_workload(32_000)), "turnkv")
    assert long > short > 1


def test_blog_workload_ends_at_the_context() -> None:
    turns = blog_workload(24_000)
    assert len(turns) == 10
    assert estimate(QWEN3_32B, TOY_CLUSTER, turns)[-1].prompt_tokens == 24_000
    with pytest.raises(ValueError):
        blog_workload(1_000)


def test_implied_mfu_inverts_prefill_time() -> None:
    _, model, cluster = published_scenarios()[1]
    ms = prefill_ms(model, cluster, 0, 20_000)
    assert implied_mfu(model, cluster, 20_000, ms) == pytest.approx(cluster.mfu)


@pytest.mark.parametrize("knob", ["link_efficiency", "fixed_ms"])
def test_calibration_reproduces_the_published_figure(knob: Knob) -> None:
    pub, model, cluster = published_scenarios()[0]
    turns = blog_workload(pub.context_tokens)
    fitted = calibrate(model, cluster, turns, pub.ttft_speedup, knob)
    assert fitted is not None
    speedup = typical_speedup(estimate(model, fitted, turns), "bidirectional")
    assert speedup == pytest.approx(pub.ttft_speedup, rel=1e-3)


def test_calibration_gives_up_when_no_value_fits() -> None:
    pub, model, cluster = published_scenarios()[0]
    assert calibrate(model, cluster, blog_workload(24_000), 1e6, "fixed_ms") is None


def test_markdown_is_labelled_and_shows_the_published_figures() -> None:
    scenarios = published_estimates()
    summary = estimate_summary_markdown(scenarios)
    assert ESTIMATE_LABEL in summary
    for pub in PUBLISHED:
        assert f"{pub.ttft_speedup:.1f}x" in summary
    turns = estimate_turns_markdown(scenarios[0].rows)
    assert ESTIMATE_LABEL in turns and all(m in turns for m in MODES)
    assert len(turns.strip().splitlines()) == 2 + 2 + 10  # label, blank, header, rule, 10 turns
