"""The engine's `Fingerprint`, read from vLLM's configuration as the engine resolved it.

The worker computes it once its model is loaded (vLLM builds the worker's connector then), so
what vLLM decided is known: the attention backend its layers use and the KV cache layout the
engine core chose. The model is named by a digest of its weights (`checkpoint`), not by its
path, which may differ between hosts that load the same checkpoint; its configuration by a
digest of the Hugging Face config after vLLM applied ``--hf-overrides`` (rope scaling given on
the command line is in it, and absent from config.json). The tokenizer is checked per
transfer, by the digest of the tokens moved. The worker adds the KV tensors' own description
when it registers them (`worker_side`).
"""

from __future__ import annotations

from typing import Any

from turnkv_server.connector.checkpoint import checkpoint_digest
from turnkv_server.connector.identity import Fingerprint, config_digest


def engine_fingerprint(vllm_config: Any) -> Fingerprint:
    """What a peer must share with this engine for KV to be copied between them."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    return Fingerprint.of({
        "model": checkpoint_digest(model.model, model.revision),
        "config": config_digest(_config_dict(model.hf_config)),
        "revision": f"{model.revision or '-'}/{model.code_revision or '-'}",
        "quantization": model.quantization or "-",
        "dtype": model.dtype,
        "kv_cache_dtype": cache.cache_dtype,
        "block_size": cache.block_size,
        "attention_backend": attention_backends(vllm_config),
        # vLLM's name for the order of the cache's dimensions in memory (NHD/HND-like).
        "kv_cache_layout": getattr(cache, "kv_cache_layout", None) or "-",
    })


def attention_backends(vllm_config: Any) -> str:
    """The attention backends the model's layers use, by vLLM's names."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    return ",".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)}))


def _config_dict(hf_config: Any) -> dict[str, Any]:
    to_dict = getattr(hf_config, "to_dict", None)
    return dict(to_dict() if callable(to_dict) else vars(hf_config))
