"""Adapters for agent frameworks, built on `turnkv.http_client()`:

- `turnkv.integrations.langchain.ChatTurnKV`: a LangChain `ChatOpenAI`;
- `turnkv.integrations.llamaindex.TurnKVLLM`: a LlamaIndex `OpenAILike`.

Each carries a `turnkv.Session`, tags every call it makes as a turn of that session, and puts
the turn's stats where its framework reports usage. Import the submodule you need: this
package imports neither framework, so `import turnkv` works without them (install the
`langchain` or `llamaindex` extra).
"""
