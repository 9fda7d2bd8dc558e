"""Cost models for GPU fleets from published figures, where no `turnkv bench` run exists:
Qwen3-32B (its shape as `bench.estimate.QWEN3_32B` states it, with sources) on H200 and H100.

Each is arithmetic on datasheet figures with stated efficiencies, not a measurement:
- prefill: 2 x active parameters FLOPs per token, plus attention to the context
  (`ModelShape.attn_flops_per_key` per key), at `mfu` of the engine's dense bf16 peak;
- decode step: the weights read once per step, plus each sequence's KV at the profile's
  context, at `hbm_efficiency` of the HBM bandwidth;
- KV transfer: the engine's share of its node's network (EFA 3.2 Tbps per 8 GPUs, as
  `bench.estimate.h200_efa`) at its link efficiency; tier reads over PCIe Gen5 x16;
- KV capacity: the GPU memory vLLM takes (`gpu_memory_utilization` 0.9) less the weights.

Figures (docs/simulator.md links them): H200 141 GB HBM3e at 4.8 TB/s, H100 SXM 80 GB HBM3 at
3.35 TB/s, both 989 TFLOPS dense bf16 (NVIDIA's datasheets).
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv_server.bench.estimate import QWEN3_32B, ModelShape
from turnkv_server.sim.service_costs import ServiceCosts

GPU_MEMORY_UTILIZATION = 0.9
BF16_BYTES = 2
# Assumptions, as `bench.estimate` states its own: achieved fractions of the peaks.
MFU = 0.4
HBM_EFFICIENCY = 0.7
LINK_EFFICIENCY = 0.6
EFA_BYTES_PER_S_PER_GPU = 3.2e12 / 8 / 8  # 3.2 Tbps per node of 8 GPUs
PCIE5_BYTES_PER_S = 55e9  # x16, achieved host-to-device copies
# A step's fixed cost beyond the arithmetic: scheduling, sampling, the first decode step.
PREFILL_FIXED_MS = 20.0


@dataclass(frozen=True)
class GpuProfile:
    name: str
    gpu: str
    gpus_per_engine: int  # tensor parallel
    hbm_bytes: float  # per GPU
    hbm_bytes_per_s: float
    peak_flops: float  # dense bf16, per GPU
    model: ModelShape = QWEN3_32B
    context_tokens: int = 24_000  # the sessions' typical context (the decode step's KV reads)

    def costs(self) -> ServiceCosts:
        m, g = self.model, self.gpus_per_engine
        flops_per_ms = self.peak_flops * MFU * g / 1000
        weights = m.active_params * BF16_BYTES
        bytes_per_ms = self.hbm_bytes_per_s * HBM_EFFICIENCY * g / 1000
        capacity = int((self.hbm_bytes * g * GPU_MEMORY_UTILIZATION - weights)
                       / m.kv_bytes_per_token)
        link = EFA_BYTES_PER_S_PER_GPU * g * LINK_EFFICIENCY / 1000 / m.kv_bytes_per_token
        return ServiceCosts(
            name=self.name,
            prefill_fixed_ms=PREFILL_FIXED_MS,
            prefill_ms_per_token=2 * m.active_params / flops_per_ms,
            prefill_ms_per_token_per_kctx=m.attn_flops_per_key() * 1000 / flops_per_ms,
            decode_fixed_ms=weights / bytes_per_ms,
            decode_ms_per_seq=self.context_tokens * m.kv_bytes_per_token / bytes_per_ms,
            transfer_tokens_per_ms=link,
            tier_tokens_per_ms=PCIE5_BYTES_PER_S * g / 1000 / m.kv_bytes_per_token,
            kv_capacity_tokens=capacity,
            block_size=16,
            prefill_chunk_tokens=8192,
            kv_bytes_per_token=m.kv_bytes_per_token,
            source=f"{m.name} on {g}x {self.gpu}: datasheet figures, MFU {MFU:.0%}, "
                   f"HBM efficiency {HBM_EFFICIENCY:.0%}, link efficiency {LINK_EFFICIENCY:.0%}")


PROFILES: dict[str, GpuProfile] = {
    "h200-qwen3-32b": GpuProfile("h200-qwen3-32b", "H200", 1, 141e9, 4.8e12, 989e12),
    "h100-qwen3-32b": GpuProfile("h100-qwen3-32b", "H100 SXM", 2, 80e9, 3.35e12, 989e12),
}
