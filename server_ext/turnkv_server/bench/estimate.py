"""An ESTIMATE of per-turn TTFT on a GPU cluster, from a workload's turn structure.

Nothing here is measured on GPUs: it is arithmetic on published model shapes, published peak
FLOPs and link bandwidths, and stated efficiency assumptions, for putting this machine's
measurements in the context of vLLM's published figures. Every output says ESTIMATE.

Per turn, with P the prompt's tokens and H the history (the previous prompt and its output):
- `standard-nocache` (vLLM's blog baseline, prefill cache off): prefill all P tokens, then
  the decode node reads all P tokens' KV.
- `standard` (prefill cache on): prefill what the prefill cache lacks (it holds the previous
  prompt, never the previous output, which was generated on the decode node; no eviction
  during tool time is assumed), then the decode node reads all P tokens' KV (round robin over
  a decode pool: the decode node lacks the session).
- `bidirectional` (upstream vLLM): the prefill node first reads the H tokens back from the
  decode node, prefills the new tokens, then the decode node reads those new tokens' KV.
- `turnkv`: prefill the new tokens only (the previous output was pushed back to the prefill node
  during tool time) and write their KV layer by layer while later layers compute.

Layer-by-layer overlap: layer i's KV is sent while layer i+1 computes, an L-stage pipeline
with compute C/L and transfer X/L per stage, which finishes after max(C, X) + min(C, X) / L.

Not modelled: queueing behind other requests, batching with decode steps, chunked-prefill
scheduling, transfer setup latency. `fixed_ms` stands in for all of them, and they can move
the ratios a lot: `calibrate` shows how much, against vLLM's published figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Literal, get_args

ESTIMATE_LABEL = "ESTIMATE (arithmetic model, not a measurement)"
MODES = ("standard-nocache", "standard", "bidirectional", "turnkv")


@dataclass(frozen=True)
class ModelShape:
    """What prefill costs and how much KV a token has, for one model."""

    name: str
    active_params: float  # dense: all parameters; MoE: the activated ones
    layers: int
    attn_heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_bytes_per_token: int  # all layers, as the KV cache stores it
    attn_window: int | None = None  # sparse attention: at most this many keys per query
    indexer_flops_per_key: float = 0.0  # per layer, per (query, key): DSA's lightning indexer

    def attn_flops_per_key(self) -> float:
        """FLOPs, all layers, for one query attending to one key: QK^T plus AV, 2 per MAC."""
        return 2.0 * self.layers * self.attn_heads * (self.qk_head_dim + self.v_head_dim)


# Qwen3-32B: 32.8B parameters, dense (Qwen3 model card); 64 layers, hidden 5120, 64 query heads,
# 8 KV heads (GQA), head dim 128 (MindSpeed-RL configs/model/qwen3_32b.yaml, matching the HF
# config.json). KV per token, bf16: 64 layers x 2 (K, V) x 8 heads x 128 x 2 bytes = 256 KiB.
QWEN3_32B = ModelShape(
    name="Qwen3-32B",
    active_params=32.8e9,
    layers=64,
    attn_heads=64,
    qk_head_dim=128,
    v_head_dim=128,
    kv_bytes_per_token=64 * 2 * 8 * 128 * 2,
)

# GLM-5: 744B parameters, 40B active (GLM-5 README). Shape from the GlmMoeDsa config (as in
# NVIDIA NeMo-RL's FLOPs tests and transformers' GlmMoeDsaConfig): 78 layers, 64 heads, MLA with
# kv_lora_rank 512, qk_nope_head_dim 192 + qk_rope_head_dim 64, v_head_dim 256; DSA with
# index_topk 2048, indexer 32 heads x 128 dims. Prefill runs MLA as MHA over decompressed K/V.
# KV per token per layer in vLLM's default fp8 DSA cache (vLLM recipes, DeepSeek-V3.2: "the
# default config uses a custom fp8 kvcache"; GLM-5 is DeepSeek-V3.2-style): 512 latent dims in
# fp8 + 4 fp32 scales + 64 rope dims in bf16 = 656 B, plus the indexer key, 128 fp8 + one fp32
# scale = 132 B. 78 x 788 B = 61,464 B. That layout is our assumption for GLM-5-FP8 in vLLM.
GLM5 = ModelShape(
    name="GLM-5 (744B, 40B active)",
    active_params=40e9,
    layers=78,
    attn_heads=64,
    qk_head_dim=192 + 64,
    v_head_dim=256,
    kv_bytes_per_token=78 * (656 + 132),
    attn_window=2048,
    indexer_flops_per_key=2.0 * 32 * 128,
)


@dataclass(frozen=True)
class NodePair:
    """One prefill instance and one decode instance, each a whole node, and the link between."""

    name: str
    gpus_per_instance: int
    peak_flops_per_gpu: float  # dense, in the prefill's compute dtype
    mfu: float  # achieved fraction of peak in prefill: an ASSUMPTION, stated in the output
    link_bytes_per_s: float  # node to node, aggregate over all NICs
    link_efficiency: float  # achieved fraction of the link rate: an ASSUMPTION
    fixed_ms: float  # per turn, every mode: scheduling, first decode step, RPCs: an ASSUMPTION


def h200_efa(peak_flops_per_gpu: float, *, mfu: float = 0.4, link_efficiency: float = 0.6,
             fixed_ms: float = 30.0) -> NodePair:
    """AWS p5en-like: 8 x H200 per node, EFA at 3,200 Gbps per node (16 x 200 Gbps EFAv3).

    H200 dense peak: 989 TFLOPS bf16, 1,979 TFLOPS fp8 (NVIDIA's figures halved from the
    with-sparsity ones). `mfu`, `link_efficiency` and `fixed_ms` are assumptions; change them.
    """
    return NodePair(
        name="8xH200 + EFA 3.2 Tbps",
        gpus_per_instance=8,
        peak_flops_per_gpu=peak_flops_per_gpu,
        mfu=mfu,
        link_bytes_per_s=3.2e12 / 8,
        link_efficiency=link_efficiency,
        fixed_ms=fixed_ms,
    )


H200_BF16_FLOPS = 989e12
H200_FP8_FLOPS = 1979e12


@dataclass(frozen=True)
class TurnShape:
    """One turn's size: tokens appended to the prompt (the first turn: system prompt too), and
    tokens generated."""

    new_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TurnEstimate:
    """Estimated TTFT of one turn in each mode, and each mode's ratio against the baseline."""

    turn: int
    prompt_tokens: int
    history_tokens: int
    ttft_ms: dict[str, float] = field(default_factory=dict)
    speedup_vs_baseline: dict[str, float] = field(default_factory=dict)


def sum_keys(start: int, end: int, window: int | None = None) -> float:
    """Keys attended, summed over queries at positions start..end-1 (query p sees p keys),
    each query capped at `window` keys when the attention is sparse."""
    if end <= start:
        return 0.0
    if window is None or end <= window:
        return (end * (end - 1) - start * (start - 1)) / 2
    if start >= window:
        return float((end - start) * window)
    return sum_keys(start, window) + (end - window) * window


def prefill_flops(model: ModelShape, start: int, end: int) -> float:
    """FLOPs to prefill tokens start..end-1 with KV for 0..start-1 already in place."""
    linear = 2.0 * model.active_params * max(end - start, 0)
    attn = model.attn_flops_per_key() * sum_keys(start, end, model.attn_window)
    indexer = model.indexer_flops_per_key * model.layers * sum_keys(start, end)
    return linear + attn + indexer


def prefill_ms(model: ModelShape, cluster: NodePair, start: int, end: int) -> float:
    """Prefill time at the cluster's assumed MFU."""
    rate = cluster.peak_flops_per_gpu * cluster.gpus_per_instance * cluster.mfu
    return 1e3 * prefill_flops(model, start, end) / rate


def transfer_ms(model: ModelShape, cluster: NodePair, tokens: int) -> float:
    """Time to move `tokens` tokens' KV between the nodes at the assumed link efficiency."""
    rate = cluster.link_bytes_per_s * cluster.link_efficiency
    return 1e3 * tokens * model.kv_bytes_per_token / rate


def overlapped_ms(compute_ms: float, transfer: float, layers: int) -> float:
    """An L-stage compute/transfer pipeline: max(C, X) + min(C, X) / L."""
    return max(compute_ms, transfer) + min(compute_ms, transfer) / layers


def turn_ttft_ms(model: ModelShape, cluster: NodePair, prompt: int, history: int,
                 cached_prompt: int) -> dict[str, float]:
    """Each mode's TTFT for a turn of `prompt` tokens whose first `history` tokens are the
    previous prompt and output, and whose first `cached_prompt` are the previous prompt."""
    new = prompt - history
    return {
        "standard-nocache": cluster.fixed_ms + prefill_ms(model, cluster, 0, prompt)
        + transfer_ms(model, cluster, prompt),
        "standard": cluster.fixed_ms + prefill_ms(model, cluster, cached_prompt, prompt)
        + transfer_ms(model, cluster, prompt),
        "bidirectional": cluster.fixed_ms + transfer_ms(model, cluster, history)
        + prefill_ms(model, cluster, history, prompt) + transfer_ms(model, cluster, new),
        "turnkv": cluster.fixed_ms + overlapped_ms(
            prefill_ms(model, cluster, history, prompt), transfer_ms(model, cluster, new),
            model.layers),
    }


def estimate(model: ModelShape, cluster: NodePair, turns: Sequence[TurnShape],
             baseline: str = "standard-nocache") -> list[TurnEstimate]:
    """Per-turn TTFT estimates for one session of `turns`, and speedups (baseline / mode)."""
    out: list[TurnEstimate] = []
    prompt = history = previous_prompt = 0
    for i, t in enumerate(turns):
        prompt = history + t.new_tokens
        ttft = turn_ttft_ms(model, cluster, prompt, history, previous_prompt)
        out.append(TurnEstimate(
            turn=i, prompt_tokens=prompt, history_tokens=history, ttft_ms=ttft,
            speedup_vs_baseline={m: ttft[baseline] / v for m, v in ttft.items()},
        ))
        previous_prompt, history = prompt, prompt + t.output_tokens
    return out


def blog_workload(final_prompt_tokens: int, turns: int = 10, new_tokens: int = 150,
                  output_tokens: int = 300) -> list[TurnShape]:
    """vLLM's blog workload shape (10 turns, +150 input and 300 output tokens per turn).

    The blog gives the context length ("24k", "20k") but not how it grows; we read it as the
    last turn's prompt and put the rest in the first turn (a long shared head): an assumption.
    """
    first = final_prompt_tokens - (turns - 1) * (new_tokens + output_tokens)
    if first < new_tokens:
        raise ValueError("final_prompt_tokens is too short for that many turns")
    return [TurnShape(first, output_tokens)] + [
        TurnShape(new_tokens, output_tokens) for _ in range(turns - 1)
    ]


@dataclass(frozen=True)
class Published:
    """A figure vLLM published for bidirectional transfer against prefill-cache-off P/D."""

    model: str
    context_tokens: int
    ttft_speedup: float
    source: str = (
        "vLLM blog 'Improve TTFT for Multi-Turn Agentic Workloads with Bi-Directional KV "
        "Transfer' (PR #32553): 2 x p5en (8xH200, EFA), 10 conversations x 10 turns"
    )


PUBLISHED = (
    Published(model="Qwen3-32B", context_tokens=24_000, ttft_speedup=1.6),
    Published(model="GLM-5-FP8", context_tokens=20_000, ttft_speedup=3.3),
)


def published_scenarios() -> list[tuple[Published, ModelShape, NodePair]]:
    """The two published set-ups, with the shapes and clusters this module assumes for them."""
    return [
        (PUBLISHED[0], QWEN3_32B, h200_efa(H200_BF16_FLOPS)),
        (PUBLISHED[1], GLM5, h200_efa(H200_FP8_FLOPS)),
    ]


def implied_mfu(model: ModelShape, cluster: NodePair, tokens: int, measured_ms: float) -> float:
    """The MFU that a measured cold prefill of `tokens` tokens implies on `cluster`: plug a
    measurement taken on the real hardware back in with `dataclasses.replace(cluster, mfu=...)`."""
    peak = cluster.peak_flops_per_gpu * cluster.gpus_per_instance
    return prefill_flops(model, 0, tokens) / (peak * measured_ms / 1e3)


def typical_speedup(rows: Sequence[TurnEstimate], mode: str) -> float:
    """Median speedup over the turns after the first: the first turn has no history to reuse."""
    later = rows[1:] or rows
    return median(r.speedup_vs_baseline[mode] for r in later)


Knob = Literal["link_efficiency", "fixed_ms"]


def calibrate(model: ModelShape, cluster: NodePair, turns: Sequence[TurnShape],
              published_speedup: float, knob: Knob,
              mode: str = "bidirectional") -> NodePair | None:
    """The cluster with one assumption (`knob`) refitted so that the model reproduces a
    published speedup of `mode` over the baseline; None if no value of the knob can.

    Two readings of a published figure that is far below the plain model's: transfers much
    slower than the link rate (`link_efficiency`), or a per-turn cost that no mode avoids,
    such as queueing behind other sessions (`fixed_ms`). They bracket what the same
    conditions would leave of turnkv's gain. The speedup rises with link efficiency and falls
    with fixed cost, so bisection finds the one value that matches.
    """
    def speedup(value: float) -> float:
        changed = _with(cluster, knob, value)
        return typical_speedup(estimate(model, changed, turns), mode)

    rising = knob == "link_efficiency"
    low, high = (1e-6, 1.0) if rising else (0.0, 1e7)
    best = high if rising else low
    if speedup(best) < published_speedup:
        return None
    for _ in range(80):
        mid = (low + high) / 2
        if (speedup(mid) < published_speedup) == rising:
            low = mid
        else:
            high = mid
    return _with(cluster, knob, (low + high) / 2)


def _with(cluster: NodePair, knob: Knob, value: float) -> NodePair:
    if knob == "link_efficiency":
        return replace(cluster, link_efficiency=value)
    return replace(cluster, fixed_ms=value)


@dataclass(frozen=True)
class ScenarioEstimate:
    """One published set-up under one reading of the assumptions, with its estimated speedups."""

    published: Published
    model: ModelShape
    reading: str  # "as assumed", or which assumption was refitted to the published figure
    cluster: NodePair
    rows: list[TurnEstimate]

    def speedup(self, mode: str) -> float:
        """Median speedup of `mode` over the baseline, turns after the first."""
        return typical_speedup(self.rows, mode)


def published_estimates() -> list[ScenarioEstimate]:
    """Each published set-up as assumed, then refitted on each knob where a value fits."""
    out = []
    for pub, model, cluster in published_scenarios():
        turns = blog_workload(pub.context_tokens)
        readings: list[tuple[str, NodePair | None]] = [("as assumed", cluster)]
        readings += [
            (f"{knob} fitted", calibrate(model, cluster, turns, pub.ttft_speedup, knob))
            for knob in get_args(Knob)
        ]
        out += [
            ScenarioEstimate(pub, model, reading, fitted, estimate(model, fitted, turns))
            for reading, fitted in readings
            if fitted is not None
        ]
    return out
