"""`turnkv bench`'s options, declared once.

Each field of `BenchOptions` is one option of the command, its default and, in its metadata
(`CliOption`), its help and the least value it takes. `turnkv_server.cli` builds the command's
options from these fields, `bench.cli` checks a `BenchOptions` made in Python against the same
minimums, and `plan.BenchSettings` takes its defaults from them. The help names the
workloads (`preset_names.PRESETS`), the modes (`mode_names`) and the pressure presets' caches
from where they are declared. Nothing here needs the benchmark's extra: the command line
imports it.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from turnkv_server.bench.preset_names import PRESETS, PRESSURE
from turnkv_server.mode_names import DEFAULT_BENCH_MODES, describe_bench_modes
from turnkv_server.router.config import help_for

WORKLOADS: tuple[str, ...] = (*PRESETS, "trace")


@dataclass(frozen=True)
class CliOption:
    """How an option reads from the command line: `--NAME` (the field's name, dashed)."""

    help: str
    flag: str | None = None  # another flag than `--NAME`
    minimum: float | None = None  # the least value it takes (None: any)


def _option(default: Any, help: str, **how: Any) -> Any:
    return field(default=default, metadata={"cli": CliOption(help, **how)})


def cli_option(f: Field[Any]) -> CliOption:
    """A field's command-line declaration."""
    option: CliOption = f.metadata["cli"]
    return option


def flag(f: Field[Any]) -> str:
    """A field's flag on the command line."""
    return cli_option(f).flag or "--" + f.name.replace("_", "-")


_PRESSURE_CACHES = "; ".join(f"{name}: {p.cache_tokens:,} tokens' worth"
                             for name, p in PRESSURE.items())


@dataclass(frozen=True)
class BenchOptions:
    """The command's options, as given (None: the default)."""

    workload: str = _option("agent", " | ".join(WORKLOADS))
    trace: Path | None = _option(None, "JSONL trace for --workload trace")
    modes: str = _option(DEFAULT_BENCH_MODES, "comma-separated, run in this order (default: "
                         "every baseline beside turnkv); engines x cores each. "
                         + describe_bench_modes(with_help=True))
    model: str = _option("smollm2", "smollm2, tiny, or a local HF model folder")
    dtype: str = _option("auto", "engine dtype; auto: float32 without bf16")
    sessions: int | None = _option(None, "sessions (default: the preset's)", minimum=1)
    seed: int = _option(0, "workload seed", minimum=0)
    concurrency: int | None = _option(
        None, "closed loop: sessions at once (default: the preset's)", minimum=1)
    kv_cache_bytes: int | None = _option(
        None, f"KV cache per engine (default: the engines'; {_PRESSURE_CACHES})", minimum=1)
    max_model_len: int | None = _option(None, "engines' max_model_len", minimum=1)
    block_size: int | None = _option(
        None, "engines' KV block size in tokens (default: vLLM's, 128 on CPU; a multiple of "
        "32 on CPU)", minimum=16)
    kv_recompute_threshold: int | None = _option(
        None, "bidirectional: read back only if this many tokens are missing (vLLM: 64)",
        minimum=0)
    short_delta_tokens: int | None = _option(
        None, help_for("short_delta_tokens", with_default=True), minimum=0)
    itl_target_ms: float | None = _option(None, help_for("itl_target_ms"), minimum=0.0)
    out: Path | None = _option(None, "output folder (default: turnkv-bench/<workload>-<time>)")
    baseline: str | None = _option(
        None, "mode the ratios divide by (default: affinity if run, else standard if run, "
        "else the first)")
    turn_timeout: float = _option(300.0, "seconds one turn may take")
    stall_timeout: float = _option(
        90.0, "seconds without any output token (turns in flight) before a mode is stalled")
    repeat: int = _option(1, "run every mode this many times, interleaved (A B C A B C); "
                          "tables show the median of the runs and their range", minimum=1)


OPTION_FIELDS: tuple[Field[Any], ...] = fields(BenchOptions)
DEFAULTS = BenchOptions()
