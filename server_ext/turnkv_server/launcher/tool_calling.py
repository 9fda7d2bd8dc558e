"""Tool calling on a cluster's engines: which vLLM tool-call parser they run, and the engine
arguments the launcher owns.

vLLM answers a request that sends `tools` with `tool_choice: "auto"` (what clients send by
default) with a 400 unless the engine runs with `--enable-auto-tool-choice` and a
`--tool-call-parser`. The parser turns the text the model writes for a call into OpenAI
`tool_calls`, so it must match the format the model was trained to write, which its chat
template shows. `tool_choice: "required"` and a named tool need no parser: vLLM constrains the
output to the tools' schemas (structured outputs).
"""

from __future__ import annotations

import json
from pathlib import Path

# `ClusterConfig.tool_call_parser`: chosen from the model's chat template, or none at all.
AUTO = "auto"
OFF = "none"

# Each chat-template format's marker, most specific first, and vLLM's parser for it.
TEMPLATE_FORMATS: tuple[tuple[str, str, str], ...] = (
    ("[TOOL_CALLS]", "mistral", "Mistral's [TOOL_CALLS]"),
    ("<|tool_call|>", "granite", "Granite's <|tool_call|>"),
    ("<function=", "qwen3_coder", "Qwen3-Coder's <function=...> calls"),
    ("<tool_call>", "hermes", "<tool_call> JSON calls"),
    ("<|start_header_id|>", "llama3_json", "Llama 3's JSON calls"),
    # ChatML (SmolLM2, the tiny test model, Qwen): Hermes' <tool_call> format is ChatML's.
    ("<|im_start|>", "hermes", "ChatML"),
)
# A template of no known format: vLLM's parser for ChatML, the most common one. Where the
# model never writes its calls, "auto" answers with text; "required" still calls a tool.
FALLBACK = "hermes"

# Engine options the launcher sets itself (`EngineSpec.command`): given again through
# `engine_extra_args` they would override its own (vLLM's parser keeps the last) and break the
# cluster's wiring, or contradict `tool_call_parser`.
LAUNCHER_OPTIONS = frozenset({
    "--model", "--served-model-name", "--host", "--port", "--kv-transfer-config",
    "--enable-auto-tool-choice", "--tool-call-parser",
})


def chat_template_text(model_dir: Path) -> str:
    """Every chat template the model folder carries (transformers keeps it in
    tokenizer_config.json, or in chat_template.jinja / chat_template.json), as one text."""
    parts: list[str] = []
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        parts.append(jinja.read_text(errors="replace"))
    for name in ("tokenizer_config.json", "chat_template.json"):
        try:
            template = json.loads((model_dir / name).read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, str):
            parts.append(template)
        elif isinstance(template, list):  # named templates: [{"name", "template"}, ...]
            parts += [t.get("template", "") for t in template if isinstance(t, dict)]
    return "\n".join(parts)


def choose_parser(model_dir: Path) -> tuple[str, str]:
    """(vLLM's parser for the model's tool-call format, why): from its chat template."""
    template = chat_template_text(model_dir)
    for marker, parser, name in TEMPLATE_FORMATS:
        if marker in template:
            return parser, f"the chat template's format: {name}"
    return FALLBACK, "no known tool-call format in the chat template"


def resolve_parser(setting: str | None, model_dir: Path) -> tuple[str | None, str]:
    """The parser the engines run for `ClusterConfig.tool_call_parser` (None: tool calling
    off), and why."""
    if setting is None or setting == OFF:
        return None, "turned off"
    if setting == AUTO:
        return choose_parser(model_dir)
    return setting, "as asked"


def engine_arguments(parser: str | None) -> list[str]:
    """vLLM's options for tool calling with `parser` (None: none)."""
    return [] if parser is None else ["--enable-auto-tool-choice", "--tool-call-parser", parser]


def launcher_options_in(args: tuple[str, ...] | list[str]) -> list[str]:
    """The options of `args` that the launcher sets itself (vLLM's parser takes `--foo_bar`
    for `--foo-bar`, and `--foo=value`)."""
    found = []
    for arg in args:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name.startswith("--") and name in LAUNCHER_OPTIONS:
            found.append(arg.split("=", 1)[0])
    return found
