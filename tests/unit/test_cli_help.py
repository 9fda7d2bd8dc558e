"""`turnkv ... --help` reads in an 80-column terminal: no line is wider, and every option's
names appear whole (a name cut to `--cores-per-engi…` cannot be typed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
import typer

from turnkv_server.cli import app

WIDTH = 80


def _commands() -> dict[str, Any]:
    """Every command with options, by its words after `turnkv` (`model pull` included).
    Typer builds them with its own copy of click: they are known by what they have."""
    found: dict[str, Any] = {}
    for name, command in typer.main.get_command(app).commands.items():  # type: ignore[attr-defined]
        for sub, inner in getattr(command, "commands", {"": command}).items():
            if inner.params:
                found[f"{name} {sub}".strip()] = inner
    return found


COMMANDS = _commands()


def render_help(words: list[str], columns: int = WIDTH) -> str:
    """The help as a user's terminal shows it: the real program, COLUMNS as a terminal of
    that width sets it."""
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm-256color"}
    env.pop("TERMINAL_WIDTH", None)
    done = subprocess.run([sys.executable, "-m", "turnkv_server.cli", *words, "--help"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def test_every_command_with_options_is_checked() -> None:
    assert {"up", "bench", "status", "down", "estimate", "model pull"} <= set(COMMANDS)


@pytest.mark.parametrize("words", sorted(COMMANDS))
def test_help_fits_80_columns_with_every_option_whole(words: str) -> None:
    text = render_help(words.split())
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, "\n".join(wide)
    names = [name for param in COMMANDS[words].params if param.param_type_name == "option"
             for name in (*param.opts, *param.secondary_opts)]
    missing = [name for name in names if not appears_whole(text, name)]
    assert not missing, f"cut or missing in `turnkv {words} --help`: {missing}\n{text}"


def appears_whole(text: str, name: str) -> bool:
    """`name` stands in `text` as a word of its own: not cut (`--cores-per-engi…`) nor the
    start of a longer name (`--prefill` of `--prefill-cache`)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w…-])", text) is not None
