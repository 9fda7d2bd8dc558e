"""The vLLM engines' side of turnkv, shared by the router, the connector, the launcher and the
benchmark, none of which imports another for it:

- `protocol`: what the router tells a turnkv engine per request and what the engine answers,
  inside `kv_transfer_params["turnkv"]` (standard library only);
- `requests`: the request bodies the router sends engines over their HTTP API;
- `metrics`: an engine's `/metrics` text, read;
- `nixl_poll`, `nixl_tuning`: NIXL tuned for CPU hosts, and vLLM's own NIXL connectors with it
  (loaded by vLLM inside the engines).

Importing this package imports none of them.
"""
