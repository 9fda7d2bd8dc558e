"""A small coding agent over a local folder, on a turnkv session; see examples/coding_agent.py.

One concept per module: `tools` (the folder tools), `calls` (the tool-call formats and their
lenient parser), `prompts` (what the agent tells the model), `loop` (turns, tool runs and cache
hints), `server` (what the server supports).
"""
