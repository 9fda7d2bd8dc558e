from __future__ import annotations

import os

# Engines started by tests stay on loopback and never reach for a model hub.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_NO_USAGE_STATS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
