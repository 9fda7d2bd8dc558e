"""The turnkv KV connector: session KV under renewable leases, pushed with NIXL both ways.

Built in steps (issue 6). So far, pure parts that import nothing from vLLM: `leases`, the
engine-side lease table the connector's scheduler side will consult, and `layout`, the
per-block memory regions NIXL registers, derived from any KV tensor layout.
"""
