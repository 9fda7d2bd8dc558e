"""Which `turnkv` extra brings which module, and the words for a command that lacks one.

`pip install turnkv` is the client SDK and the `turnkv` command's shell: serving (vLLM, the
router, the launcher) comes with the `cpu` or `gpu` extra, the benchmark's plots with `bench`.
A command that needs more than the base install says which extra to install, instead of a
traceback ending in `ModuleNotFoundError: No module named 'psutil'`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

SERVING = "serving"
# Top-level module -> the extra that installs it (pyproject.toml's optional dependencies).
EXTRA_OF: dict[str, str] = {
    **dict.fromkeys(
        ("vllm", "nixl", "nixl_cu12", "psutil", "fastapi", "uvicorn", "aiohttp", "orjson",
         "prometheus_client", "redis", "gguf", "accelerate", "torch", "transformers"),
        SERVING),
    "matplotlib": "bench",
    "numpy": "bench",
    "simpy": "sim",
}
# What `turnkv up` starts: engines (vLLM), the launcher (psutil), the router (its server).
CLUSTER_MODULES = ("vllm", "psutil", "fastapi", "uvicorn", "aiohttp")


class MissingExtraError(RuntimeError):
    """A command needs modules of an extra that is not installed; the message says which."""


def install_command(extra: str) -> str:
    if extra == SERVING:
        return ("pip install 'turnkv[cpu]' on a CPU host, or 'turnkv[gpu]' on a GPU host "
                "(in a clone of the repository: `make install`)")
    return f"pip install 'turnkv[{extra}]'"


def extra_for(module: str | None) -> str | None:
    return EXTRA_OF.get((module or "").split(".")[0])


def message(command: str, modules: Iterable[str]) -> str | None:
    """What to tell a user whose `command` found `modules` missing; None if no extra of
    turnkv brings them (then the error is not a missing extra, and is left as it is)."""
    missing = list(dict.fromkeys(m.split(".")[0] for m in modules))
    extras = list(dict.fromkeys(e for e in map(extra_for, missing) if e is not None))
    if not extras:
        return None
    names = ", ".join(missing)
    what = "the serving dependencies" if extras[0] == SERVING else f"the `{extras[0]}` extra"
    return (f"`{command}` needs {what}, which this installation lacks (no module {names}; "
            f"`pip install turnkv` alone is the client SDK). Install with: "
            f"{install_command(extras[0])}")


def missing(modules: Iterable[str]) -> list[str]:
    """The modules that cannot be imported, found without importing them."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent


def require(command: str, modules: Iterable[str]) -> None:
    """Raise `MissingExtraError` if any of `modules` is missing: before a command starts
    processes that would each fail on it (an engine without vLLM dies in its own log)."""
    absent = missing(modules)
    text = message(command, absent) if absent else None
    if text is not None:
        raise MissingExtraError(text)
