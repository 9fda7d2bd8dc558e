"""vLLM's own configuration and scheduler for the connector's tests: no weights, no worker.

`model_folder` writes the config.json of a small Llama (the only file vLLM's `ModelConfig`
reads with the tokenizer skipped); `engine_config` builds the `VllmConfig` an engine with that
`--kv-transfer-config` would run, and `scheduler` vLLM's scheduler over it, which builds the
scheduler's connector as an engine core does. `step` feeds it what a worker reported.
`ConnectorBeside` is the shape of a test's connector beside turnkv under `MultiConnector`.
"""

from __future__ import annotations

import json
from copy import copy
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_LEN = 1024
CONNECTOR_MODULE = "turnkv_server.connector.vllm_connector"

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "dtype": "float32",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


class ConnectorBeside(KVConnectorBase_V1):
    """A connector to put beside turnkv under MultiConnector: its worker half does nothing;
    subclasses say what its scheduler half finds."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def model_folder(root: Path, **config: Any) -> Path:
    """A model folder holding only a config.json (the small Llama's, with `config` over it)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**LLAMA, **config}))
    return root


def turnkv(**settings: Any) -> dict[str, Any]:
    """The turnkv connector's --kv-transfer-config, `settings` over the launcher's keys."""
    return {"kv_connector": "TurnkvConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", **settings}


def engine_config(folder: Path, kv_transfer: dict[str, Any] | KVTransferConfig | None,
                  dtype: Any = "float32", *, blocks: int = NUM_BLOCKS, max_len: int = MAX_LEN,
                  max_seqs: int = 8, **model: Any) -> VllmConfig:
    """The engine's configuration: `blocks` KV blocks of BLOCK_SIZE tokens; `model`: more of
    `ModelConfig`'s settings (`hf_overrides`, `revision`...)."""
    model_config = ModelConfig(model=str(folder), dtype=dtype, max_model_len=max_len,
                               skip_tokenizer_init=True, **model)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = blocks
    if isinstance(kv_transfer, dict):
        kv_transfer = KVTransferConfig(**kv_transfer)
    return VllmConfig(
        model_config=model_config, cache_config=cache, device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_len, max_num_seqs=max_seqs,
                                         max_model_len=max_len, is_encoder_decoder=False),
        kv_transfer_config=kv_transfer)


def scheduler(config: VllmConfig) -> Scheduler:
    """vLLM's scheduler as the engine core builds it (its connector included)."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    blocks = config.cache_config.num_gpu_blocks
    assert blocks is not None
    kv_cache = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache, block_size=BLOCK_SIZE,
                     structured_output_manager=StructuredOutputManager(config))


Outputs = dict[int, EngineCoreOutputs]


def step(sched: Scheduler, kv: KVConnectorOutput | None = None
         ) -> tuple[SchedulerOutput, Outputs]:
    """One engine step: schedule, then the worker's answer (a token for each request that
    ran; `kv`: what the connector reported)."""
    out = sched.schedule()
    ran = list(out.num_scheduled_tokens)
    if ran:
        result = ModelRunnerOutput(
            req_ids=ran, req_id_to_index={r: i for i, r in enumerate(ran)},
            sampled_token_ids=[[7] for _ in ran])
    else:
        result = copy(EMPTY_MODEL_RUNNER_OUTPUT)
    result.kv_connector_output = kv
    return out, sched.update_from_output(out, result)
