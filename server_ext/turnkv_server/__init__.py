"""turnkv_server: the serving side of turnkv (launcher, router, vLLM KV connector)."""

__version__ = "0.1.0"
