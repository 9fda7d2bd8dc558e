"""Adapters for agent frameworks, built on `turnkv.http_client()`:

- `turnkv.integrations.langchain.ChatTurnKV`: a LangChain `ChatOpenAI`;
- `turnkv.integrations.llamaindex.TurnKVLLM`: a LlamaIndex `OpenAILike`.

Each carries a `turnkv.Session`, tags every call it makes as a turn of that session, and puts
the turn's stats where its framework reports usage. Import the submodule you need: this
package imports neither framework, so `import turnkv` works without them (install the
`langchain` or `llamaindex` extra).
"""

from __future__ import annotations

from typing import NoReturn


def raise_extra_missing(exc: ModuleNotFoundError, extra: str, packages: tuple[str, ...],
                        framework: str, adapter: str) -> NoReturn:
    """Raise, for an adapter whose framework failed to import, a `ModuleNotFoundError` still
    (`except ImportError` keeps working) that names the extra to install, chained to `exc`.
    Where the missing module is not the framework's, `exc` itself stands as is."""
    if (exc.name or "").split(".")[0] not in packages:
        raise exc
    raise ModuleNotFoundError(
        f"{adapter} needs {framework}, which is not installed (no module {exc.name!r}): "
        f"pip install 'turnkv[{extra}]'", name=exc.name) from exc
