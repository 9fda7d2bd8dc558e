"""Tool calling on by default: every engine a cluster starts runs vLLM's tool-call parser for
its model (`--enable-auto-tool-choice --tool-call-parser NAME`), `turnkv up` can pick another
or none, and passes any other engine argument through.

That requests with `tools` then reach the model is tested on real engines in
tests/integration/test_tool_calling.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import turnkv_server.launcher as launcher
from turnkv_server.cli import app
from turnkv_server.launcher import Cluster, ClusterConfig
from turnkv_server.launcher.tool_calling import choose_parser
from turnkv_server.models.tiny import CHAT_TEMPLATE as TINY_TEMPLATE

# SmolLM2-135M-Instruct's template as its checkpoint carries it (chat_template.jinja).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def model_folder(tmp_path: Path, template: str | None, *, jinja: bool = False) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None and jinja:
        (folder / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tool_flags(command: list[str]) -> list[str]:
    flags = [a for a in command if a == "--enable-auto-tool-choice"]
    if "--tool-call-parser" in command:
        flags += ["--tool-call-parser", command[command.index("--tool-call-parser") + 1]]
    return flags


def engine_commands(tmp_path: Path, model: Path, **config: Any) -> list[list[str]]:
    cluster = Cluster(ClusterConfig(run_dir=tmp_path / "run", **config))
    return [spec.command(tmp_path / "port") for spec in cluster._engine_specs(model, "m")]


def test_the_built_in_models_get_the_chatml_parser(tmp_path: Path) -> None:
    tiny = model_folder(tmp_path / "a", TINY_TEMPLATE)
    smollm2 = model_folder(tmp_path / "b", SMOLLM2_TEMPLATE, jinja=True)
    for folder in (tiny, smollm2):
        parser, why = choose_parser(folder)
        assert parser == "hermes" and "ChatML" in why


@pytest.mark.parametrize(("template", "parser"), [
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("<|im_start|>{% if tools %}<tool_call>{{ tool_call }}</tool_call>{% endif %}", "hermes"),
    ("<|im_start|><tool_call>\n<function={{ name }}>", "qwen3_coder"),
    ("<|start_header_id|>{{ role }}<|end_header_id|>", "llama3_json"),
    ("<|start_of_role|><|tool_call|>", "granite"),
    ("{{ messages }}", "hermes"),  # no known format: the ChatML one
])
def test_the_parser_follows_the_chat_templates_format(tmp_path: Path, template: str,
                                                      parser: str) -> None:
    assert choose_parser(model_folder(tmp_path, template))[0] == parser


def test_named_templates_and_a_folder_without_one(tmp_path: Path) -> None:
    named = model_folder(tmp_path / "a", None)
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "x"},
        {"name": "tool_use", "template": "[TOOL_CALLS]"}]}))
    assert choose_parser(named)[0] == "mistral"
    assert choose_parser(tmp_path / "missing") == ("hermes", "no known tool-call format in "
                                                   "the chat template")


@pytest.mark.parametrize("mode", ["single", "standard", "bidirectional", "turnkv",
                                  "affinity"])
def test_every_engine_runs_the_models_parser_by_default(tmp_path: Path, mode: str) -> None:
    model = model_folder(tmp_path, TINY_TEMPLATE)
    commands = engine_commands(tmp_path, model, mode=mode)
    assert commands
    for command in commands:
        assert tool_flags(command) == ["--enable-auto-tool-choice", "--tool-call-parser",
                                       "hermes"]


def test_another_parser_none_and_more_engine_arguments(tmp_path: Path) -> None:
    model = model_folder(tmp_path, TINY_TEMPLATE)
    for command in engine_commands(tmp_path, model, tool_call_parser="llama3_json"):
        assert tool_flags(command)[1:] == ["--tool-call-parser", "llama3_json"]
    for setting in ("none", None):
        for command in engine_commands(tmp_path, model, tool_call_parser=setting):
            assert tool_flags(command) == []
    extra = ("--max-num-seqs=8", "--seed", "3")
    for command in engine_commands(tmp_path, model, engine_extra_args=extra):
        assert command[-3:] == list(extra)  # last: vLLM keeps the last value given


@pytest.mark.parametrize("arg", ["--port=9", "--host", "--model", "--tool-call-parser",
                                 "--tool_call_parser=x", "--enable-auto-tool-choice",
                                 "--kv-transfer-config={}", "--served-model-name"])
def test_engine_arguments_the_launcher_sets_are_refused(arg: str) -> None:
    with pytest.raises(ValueError, match="set by turnkv itself"):
        ClusterConfig(engine_extra_args=(arg, "x"))


class Started(Exception):
    pass


def up_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> ClusterConfig:
    """The configuration `turnkv up ARGS` would start."""
    monkeypatch.setenv("TURNKV_HOME", str(tmp_path / "home"))
    seen: list[ClusterConfig] = []

    class FakeCluster:
        def __init__(self, config: ClusterConfig, console: object = None) -> None:
            seen.append(config)

        def start(self) -> None:
            raise Started

    monkeypatch.setattr(launcher, "Cluster", FakeCluster)
    result = CliRunner().invoke(app, ["up", *args])
    assert result.exit_code == 1 and isinstance(seen[0], ClusterConfig), result.output
    return seen[0]


def test_turnkv_up_turns_tool_calling_on_and_passes_engine_arguments(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    default = up_config(monkeypatch, tmp_path)
    assert (default.tool_call_parser, default.engine_extra_args) == ("auto", ())
    chosen = up_config(monkeypatch, tmp_path, "--tool-call-parser", "mistral",
                       "--engine-arg=--max-num-seqs=8", "--engine-arg", "--seed",
                       "--engine-arg", "3")
    assert chosen.tool_call_parser == "mistral"
    assert chosen.engine_extra_args == ("--max-num-seqs=8", "--seed", "3")
    assert up_config(monkeypatch, tmp_path, "--tool-call-parser", "none").tool_call_parser == (
        "none")


def test_turnkv_up_refuses_an_engine_argument_it_sets_itself(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TURNKV_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, ["up", "--engine-arg=--port=8000"])
    assert result.exit_code == 2
    assert "set by turnkv itself" in result.output
