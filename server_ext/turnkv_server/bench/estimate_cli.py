"""`turnkv estimate`: the scale ESTIMATE for a described GPU cluster, as tables and JSON.

The arithmetic lives in `estimate`; this module picks the model, cluster and turns from the
options, lets measurements taken on the real hardware replace the assumptions (a cold prefill
time sets the MFU, a measured node-to-node rate the link), and prints the result beside vLLM's
published figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from turnkv_server.bench import estimate as est
from turnkv_server.bench import report
from turnkv_server.bench.plan import PlanError
from turnkv_server.bench.presets import PRESETS, build_workload

MODELS = {"qwen3-32b": (est.QWEN3_32B, est.H200_BF16_FLOPS),
          "glm-5": (est.GLM5, est.H200_FP8_FLOPS)}


@dataclass(frozen=True)
class EstimateOptions:
    """The command's options; None means the assumption in `estimate.h200_efa`."""

    model: str = "qwen3-32b"
    workload: str = "blog"
    context: int | None = None
    mfu: float | None = None
    link_efficiency: float | None = None
    fixed_ms: float | None = None
    measured_prefill: str | None = None  # "TOKENS:MS", a cold prefill on the target cluster
    link_gbps: float | None = None  # a measured node-to-node KV rate, in Gbit/s
    json_out: Path | None = None


def parse_measured_prefill(text: str) -> tuple[int, float]:
    """'8000:412' -> (8000 tokens, 412.0 ms)."""
    try:
        tokens, ms = text.split(":")
        parsed = int(tokens), float(ms)
    except ValueError as exc:
        raise PlanError(f"--measured-prefill takes TOKENS:MS, such as 8000:412, not {text!r}"
                        ) from exc
    if parsed[0] < 1 or parsed[1] <= 0:
        raise PlanError("--measured-prefill needs positive tokens and milliseconds")
    return parsed


def cluster_for(options: EstimateOptions) -> tuple[est.ModelShape, est.NodePair, list[str]]:
    """The model shape and the cluster with every override applied; and where each came from."""
    if options.model not in MODELS:
        raise PlanError(f"unknown model {options.model!r}; choose from {', '.join(MODELS)}")
    model, peak = MODELS[options.model]
    cluster = est.h200_efa(peak)
    sources = []
    for name in ("mfu", "link_efficiency", "fixed_ms"):
        value = getattr(options, name)
        if value is not None:
            if value < 0 or (name != "fixed_ms" and not 0 < value <= 1):
                raise PlanError(f"--{name.replace('_', '-')} is out of range: {value}")
            cluster = replace(cluster, **{name: value})
            sources.append(f"{name} given")
    if options.measured_prefill is not None:
        tokens, ms = parse_measured_prefill(options.measured_prefill)
        mfu = est.implied_mfu(model, cluster, tokens, ms)
        cluster = replace(cluster, mfu=mfu)
        sources.append(f"MFU {mfu:.1%} from a measured prefill of {tokens} tokens in {ms:g} ms")
    if options.link_gbps is not None:
        if options.link_gbps <= 0:
            raise PlanError("--link-gbps must be positive")
        cluster = replace(cluster, name=f"8xH200 + a {options.link_gbps:g} Gbit/s link",
                          link_bytes_per_s=options.link_gbps * 1e9 / 8, link_efficiency=1.0)
        sources.append(f"link measured at {options.link_gbps:g} Gbit/s")
    return model, cluster, sources


def turns_for(options: EstimateOptions) -> list[est.TurnShape]:
    """vLLM's blog shape at `context` tokens, or the longest session of a preset."""
    if options.workload == "blog":
        context = options.context or next(
            p.context_tokens for p in est.PUBLISHED if p.model.lower().startswith(
                options.model.split("-")[0]))
        try:
            return est.blog_workload(context)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
    if options.workload not in PRESETS:
        raise PlanError(f"unknown workload {options.workload!r}; choose blog or one of "
                        f"{', '.join(PRESETS)}")
    if options.context is not None:
        raise PlanError("--context goes with --workload blog")
    workload = build_workload(options.workload)
    session = max(workload.sessions, key=lambda s: len(s.turns))
    # Sizes at four characters per token: a GPU deployment's tokenizer is not at hand.
    from turnkv_server.bench.sizing import MESSAGE_OVERHEAD_TOKENS, approx_tokens

    shapes = []
    for i, turn in enumerate(session.turns):
        new = approx_tokens(turn.user) + MESSAGE_OVERHEAD_TOKENS
        if i == 0:
            new += approx_tokens(session.system) + MESSAGE_OVERHEAD_TOKENS
        shapes.append(est.TurnShape(new_tokens=new, output_tokens=turn.max_tokens))
    return shapes


def run_estimate(options: EstimateOptions, out: Console) -> dict[str, object]:
    """Print the per-turn estimate and the published comparison; return (and write) the JSON."""
    model, cluster, sources = cluster_for(options)
    rows = est.estimate(model, cluster, turns_for(options))
    out.print(f"[bold]{est.ESTIMATE_LABEL}[/]: {model.name} on {cluster.name}; MFU "
              f"{cluster.mfu:.1%}, link efficiency {cluster.link_efficiency:.0%}, "
              f"{cluster.fixed_ms:g} ms fixed per turn"
              + (f" ({'; '.join(sources)})" if sources else " (all assumed)"))
    out.print(Markdown(report.estimate_turns_markdown(rows)))
    out.print(Markdown(report.estimate_summary_markdown(est.published_estimates())))
    result: dict[str, object] = {
        "label": est.ESTIMATE_LABEL,
        "model": asdict(model),
        "cluster": asdict(cluster),
        "sources": sources,
        "turns": [asdict(r) for r in rows],
        "median_speedup_after_turn_1": {m: est.typical_speedup(rows, m) for m in est.MODES},
        "published": [asdict(p) for p in est.PUBLISHED],
    }
    if options.json_out is not None:
        options.json_out.parent.mkdir(parents=True, exist_ok=True)
        options.json_out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        out.print(f"wrote {options.json_out}")
    return result
