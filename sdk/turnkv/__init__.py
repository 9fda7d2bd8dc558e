"""turnkv: session-aware KV reuse for multi-turn agents on disaggregated vLLM."""

__version__ = "0.1.0"

__all__ = ["__version__"]
