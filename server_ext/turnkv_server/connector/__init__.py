"""The turnkv KV connector: session KV under renewable leases, pushed with NIXL both ways.

Built in steps (issue 6). So far: `leases`, the engine-side lease table (pure logic);
`holds`, which applies it to vLLM's block pool by reference counts from scheduler callbacks;
and `layout`, the per-block memory regions NIXL registers, derived from any KV tensor layout.
"""
