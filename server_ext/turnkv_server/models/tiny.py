"""A tiny random-weight Llama with a real tokenizer, for fast tests.

Its outputs are gibberish, but vLLM serves it exactly like a real model (same architecture,
ChatML template, byte-level BPE), at a fraction of the cost. The build is deterministic:
the same machine and library versions give the same bytes, so tests can pin behaviour.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ._store import (
    ModelError,
    Progress,
    build_once,
    manifest_problem,
    say,
    write_manifest,
)

TINY = "tiny"

# Bumped whenever the recipe changes, so folders built by an older recipe are rebuilt.
RECIPE_VERSION = 1
SEED = 20240601

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, the same shape as SmolLM2's template but without its default system prompt, so
# test prompts stay short and fully under the caller's control.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
}


def _source() -> dict[str, Any]:
    return {"kind": "random-llama", "recipe": RECIPE_VERSION, "seed": SEED}


def _corpus_path() -> Path:
    return Path(str(resources.files("turnkv_server") / "data" / "tiny_corpus.txt"))


def _train_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet, so any input (not only the corpus' characters) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(_corpus_path())], trainer)
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tok.token_to_id(token)
        if token_id is None:
            raise ModelError(f"tokenizer training lost the special token {token!r}")
        ids[token] = token_id

    # Written by hand rather than by transformers' save_pretrained, whose layout changes
    # between major versions (v5 moves the template to chat_template.jinja and names a v5-only
    # class); this form loads with AutoTokenizer in transformers 4 and 5 alike.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": LLAMA_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    return ids


def _build_model(out: Path, ids: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **LLAMA_CONFIG,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|im_end|>"],
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.float()
    # Re-draw every weight from one explicit generator in name order: the result then does
    # not depend on how transformers happens to initialise modules in this version.
    gen = torch.Generator().manual_seed(SEED)
    std = float(LLAMA_CONFIG["initializer_range"])
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|im_end|>"],
    )
    model.save_pretrained(str(out))


def build_tiny(home: Path | None = None, *, progress: Progress | None = None) -> Path:
    """Build (once) the tiny test model into `<home>/models/tiny/` and return that folder."""

    def same_recipe(src: dict[str, Any]) -> bool:
        return src == _source()

    def problem(folder: Path) -> str | None:
        return manifest_problem(folder, TINY, deep=True, source_check=same_recipe)

    def build(tmp: Path) -> Path:
        built = tmp / TINY
        built.mkdir()
        say(progress, "training tiny byte-level BPE tokenizer")
        ids = _train_tokenizer(built)
        say(progress, "building tiny random-weight Llama")
        _build_model(built, ids)
        write_manifest(built, TINY, _source())
        return built

    return build_once(TINY, home, problem, build, progress)
