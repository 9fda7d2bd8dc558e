"""The turnkv KV connector: session KV under renewable leases, pushed with NIXL both ways.

vLLM loads `vllm_connector.TurnkvConnector`, the same class on prefill and decode engines,
which adapts vLLM's connector interface to two halves:

- the scheduler half (`scheduler_side`, in the engine-core thread) decides per request what to
  receive, send, decline, refuse or cancel, from the router's `kv_transfer_params["turnkv"]`
  (the engine protocol, shared with the router), and hands the worker one `StepOrders` per
  step (`orders`); it keeps the sends it owes (`pending_sends`) and holds session leases by
  block references (`leases`, the lease table; `holds`, applied to vLLM's block pool;
  `idle_expiry`, on time on an idle engine too);
- the worker half (`worker_side`, in the model runner) describes the KV cache block by block
  for NIXL (`layout`, `blocktable`) and runs a transfer thread (`transport`): the receiving
  end (`receiving`, with `incoming` and `sender_links`) and the sending end (`sending`, with
  `outgoing` and `sending_peers`) of a protocol whose messages are typed, signed and encrypted
  (`side_channel`, under the cluster's secret: `cluster_secret`); every NIXL write goes through
  `writes`, and `outcomes` carries what finished back to the step thread.

`identity` is what must match before KV is copied (engine fingerprints, token digests), read
from vLLM's configuration by `engine_identity` with the weights' digest from `checkpoint`;
`settings`, the connector's settings and what it requires of the engine; `stats`, the counters
each engine exposes on `/metrics`.
"""
