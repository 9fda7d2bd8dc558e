"""The session-aware router: OpenAI-compatible HTTP in front of prefill and decode pools.

A turn goes `app` (routes, authentication, the request read) -> `turn` (the pipeline) ->
`modes` (what each engine is told) -> `engines` (placement, HTTP to the engines) -> `stats`
-> `sessions` (the session table, its store, and their service). Settings: `config`.
"""
