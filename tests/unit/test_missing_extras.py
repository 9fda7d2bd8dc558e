"""An installation without an extra (`pip install turnkv` alone: the SDK and the command's
shell) says which extra to install, instead of a traceback ending in `ModuleNotFoundError`.

Each case runs in a fresh interpreter whose imports of the extras' modules fail, as they do
where those are not installed: a `sitecustomize` on PYTHONPATH puts a finder in front of
every other that refuses them (`importlib.util.find_spec` included).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnkv_server.extras import EXTRA_OF

VENV_BIN = Path(sys.executable).parent
BLOCKER = '''
import importlib.abc, os, sys

BLOCKED = set(os.environ["TURNKV_TEST_BLOCK"].split(","))


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
'''
# Everything the extras bring: what `pip install turnkv` alone lacks.
SDK_ONLY = sorted({*EXTRA_OF, "langchain_core", "langchain_openai", "llama_index"})
SERVING_HINT = "pip install 'turnkv[cpu]' on a CPU host, or 'turnkv[gpu]' on a GPU host"


def run(tmp_path: Path, args: list[str], blocked: list[str]) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(site), "TURNKV_TEST_BLOCK": ",".join(blocked),
           "TURNKV_HOME": str(tmp_path / "home"), "COLUMNS": "80", "TERM": "dumb"}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_blocker_blocks(tmp_path: Path) -> None:
    done = run(tmp_path, [sys.executable, "-c", "import psutil"], ["psutil"])
    assert done.returncode == 1 and "No module named 'psutil'" in done.stderr


def test_the_console_script_still_helps(tmp_path: Path) -> None:
    for args in (["--help"], ["up", "--help"], []):
        done = run(tmp_path, [str(VENV_BIN / "turnkv"), *args], SDK_ONLY)
        assert "Traceback" not in done.stderr, done.stderr
        assert "Usage: turnkv" in done.stdout + done.stderr
    assert run(tmp_path, [str(VENV_BIN / "turnkv"), "--help"], SDK_ONLY).returncode == 0


@pytest.mark.parametrize("command", [
    ["up"], ["up", "--mode", "single"], ["status"], ["status", "--json"], ["down"],
    ["router", "--prefill", "http://x", "--decode", "http://y"], ["model", "pull"],
])
def test_server_commands_name_the_extra(tmp_path: Path, command: list[str]) -> None:
    done = run(tmp_path, [str(VENV_BIN / "turnkv"), *command], SDK_ONLY)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    said = flat(done.stderr)
    name = " ".join(["turnkv", *(w for w in command[:2] if not w.startswith("-"))])
    assert f"error: `{name}` needs the serving dependencies" in said, said
    assert SERVING_HINT in said
    assert "`pip install turnkv` alone is the client SDK" in said


def test_up_checks_vllm_before_starting_anything(tmp_path: Path) -> None:
    """psutil there, vLLM not: `turnkv up` refuses at once rather than start engines that
    die in their logs."""
    done = run(tmp_path, [str(VENV_BIN / "turnkv"), "up", "--model", "tiny"], ["vllm"])
    assert done.returncode == 1
    said = flat(done.stderr)
    assert "(no module vllm;" in said and SERVING_HINT in said
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.parametrize("command", [["bench", "--modes", "single"], ["bench-report", "."]])
def test_bench_without_plots_names_the_bench_extra(tmp_path: Path, command: list[str]) -> None:
    done = run(tmp_path, [str(VENV_BIN / "turnkv"), *command], ["matplotlib", "numpy"])
    assert done.returncode == 1, done.stderr
    said = flat(done.stderr)
    # The command's words, not its arguments.
    assert f"error: `turnkv {command[0]}` needs the `bench` extra" in said, said
    assert said.endswith("Install with: pip install 'turnkv[bench]'")


def test_the_sdk_imports_without_any_extra(tmp_path: Path) -> None:
    code = ("import turnkv, turnkv.integrations; "
            "print(turnkv.OpenAI.__name__, turnkv.ServerUnreachableError.__name__)")
    done = run(tmp_path, [sys.executable, "-c", code], SDK_ONLY)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OpenAI", "ServerUnreachableError"]


@pytest.mark.parametrize(("module", "extra", "blocked"), [
    ("turnkv.integrations.langchain", "langchain", ["langchain_core", "langchain_openai"]),
    ("turnkv.integrations.langchain", "langchain", ["langchain_openai"]),
    ("turnkv.integrations.llamaindex", "llamaindex", ["llama_index"]),
])
def test_adapters_name_their_extra(tmp_path: Path, module: str, extra: str,
                                   blocked: list[str]) -> None:
    code = f"""
try:
    import {module}
except ImportError as exc:  # still an ImportError: `except ImportError` keeps working
    print(type(exc).__name__, exc.name, exc, sep="|")
"""
    done = run(tmp_path, [sys.executable, "-c", code], blocked)
    assert done.returncode == 0, done.stderr
    kind, name, message = done.stdout.strip().split("|")
    assert kind == "ModuleNotFoundError" and name.split(".")[0] in blocked
    assert message.startswith(f"{module} needs ")
    assert message.endswith(f"pip install 'turnkv[{extra}]'")
