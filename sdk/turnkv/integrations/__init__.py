"""Adapters for agent frameworks, built on `turnkv.http_client()`:

- `turnkv.integrations.langchain.ChatTurnKV`: a LangChain `ChatOpenAI`;
- `turnkv.integrations.llamaindex.TurnKVLLM`: a LlamaIndex `OpenAILike`.

Each carries a `turnkv.Session`, tags every call it makes as a turn of that session, and puts
the turn's stats where its framework reports usage. Import the submodule you need: this
package imports neither framework, so `import turnkv` works without them (install the
`langchain` or `llamaindex` extra).
"""

from __future__ import annotations


def extra_missing(exc: ModuleNotFoundError, extra: str, packages: tuple[str, ...],
                  framework: str, adapter: str) -> ModuleNotFoundError | None:
    """The error to raise when an adapter's framework is not installed: a
    `ModuleNotFoundError` still (`except ImportError` keeps working) that names the extra to
    install. None when the missing module is not the framework's: that error stands as is."""
    if (exc.name or "").split(".")[0] not in packages:
        return None
    return ModuleNotFoundError(
        f"{adapter} needs {framework}, which is not installed (no module {exc.name!r}): "
        f"pip install 'turnkv[{extra}]'", name=exc.name)
