"""`turnkv bench`: options in, a plan checked, the runner run, results written and shown.

The typer command in `turnkv_server.cli` only collects the options; this module does the rest
so that it can be called (and tested) without the command line.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from rich.console import Console

from turnkv_server.bench import report
from turnkv_server.bench.options import OPTION_FIELDS, BenchOptions, cli_option, flag
from turnkv_server.bench.plan import (
    BenchSettings,
    PlanError,
    build_workload,
    kv_bytes_per_token,
    parse_modes,
    pick_baseline,
)
from turnkv_server.bench.presets import PRESSURE
from turnkv_server.bench.runner import Runner, write_outputs
from turnkv_server.bench.sizing import TokenCounter, tokenizer_counter
from turnkv_server.bench.workloads import Workload, total_context_tokens
from turnkv_server.mode_names import has_host_tier, tagged_mode

# vLLM's CPU backend allocates KV in blocks of 128 tokens (GPU backends use smaller blocks,
# for which this is a conservative estimate).
# vLLM's KV block size on CPU where none is given (upstream `platforms/cpu.py`).
VLLM_CPU_BLOCK_TOKENS = 128


def _check(options: BenchOptions) -> None:
    """The least value of each option (`options.CliOption.minimum`), for options made in
    Python as on the command line."""
    for f in OPTION_FIELDS:
        minimum, value = cli_option(f).minimum, getattr(options, f.name)
        # `not >=`: NaN is refused too.
        if minimum is not None and value is not None and not value >= minimum:
            raise PlanError(f"{flag(f)} must be at least {minimum:g}")


def _model_dir(options: BenchOptions) -> Path:
    from turnkv_server.models import ModelError, resolve_model

    try:
        return resolve_model(options.model)
    except (ModelError, OSError) as exc:
        raise PlanError(f"cannot find model {options.model!r}: {exc}") from exc


def _token_counter(model_dir: Path) -> TokenCounter:
    try:
        return tokenizer_counter(model_dir)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc


def _kv_cache_bytes(options: BenchOptions, model_dir: Path) -> tuple[int | None, int | None]:
    """(bytes per engine, tokens that is) for the pressure presets; as given for other
    workloads.

    Memory pressure needs a known, small cache: without --kv-cache-bytes it gets
    the preset's `presets.Pressure.cache_tokens` tokens' worth at the engines' dtype.
    """
    if options.workload not in PRESSURE:
        return options.kv_cache_bytes, None
    block = block_tokens(options)
    try:
        per_token = kv_bytes_per_token(model_dir, options.dtype)
    except (OSError, KeyError, ValueError) as exc:
        raise PlanError(f"cannot size the KV cache of {options.model!r}: {exc}") from exc
    # vLLM keeps one block of every cache as its null block: requests get the rest.
    if options.kv_cache_bytes is None:
        tokens = PRESSURE[options.workload].cache_tokens
        return (tokens + block) * per_token, tokens
    usable = (options.kv_cache_bytes // per_token // block - 1) * block
    if usable < block:
        raise PlanError(f"--kv-cache-bytes {options.kv_cache_bytes} holds less than two "
                        f"blocks of {block} tokens")
    return options.kv_cache_bytes, usable


def block_tokens(options: BenchOptions) -> int:
    """The engines' KV block size in tokens."""
    return options.block_size or VLLM_CPU_BLOCK_TOKENS


def _session_blocks(workload: Workload, count_tokens: TokenCounter, block: int) -> int:
    """Blocks that hold every session's whole context, with a block to spare for each (and
    vLLM's null block)."""
    tokens = total_context_tokens(workload, count_tokens)
    return -(-tokens // block) + len(workload.sessions) + 1


def _bound_kv_cache_bytes(options: BenchOptions, model_dir: Path, kv_bytes: int | None,
                          workload: Workload, count_tokens: TokenCounter) -> int | None:
    """`bound`'s cache per engine: every session's whole context (`_session_blocks`), or the
    engines' default where no cache size was set."""
    if kv_bytes is None:
        return None
    per_token = kv_bytes_per_token(model_dir, options.dtype)
    block = block_tokens(options)
    return max(kv_bytes, _session_blocks(workload, count_tokens, block) * block * per_token)


def _tier_host_blocks(options: BenchOptions, model_dir: Path, kv_bytes: int | None,
                      workload: Workload, count_tokens: TokenCounter) -> int:
    """Each engine's host tier in blocks, for the modes with one: as many as `bound`'s cache
    holds, so that the tier holds every session; where no cache size was set, every
    session's context all the same (the engines' default cache then holds most of it)."""
    block = block_tokens(options)
    block_bytes = block * kv_bytes_per_token(model_dir, options.dtype)
    bound = _bound_kv_cache_bytes(options, model_dir, kv_bytes, workload, count_tokens)
    return (bound // block_bytes if bound is not None
            else _session_blocks(workload, count_tokens, block))


def _max_model_len(options: BenchOptions, model_dir: Path, kv_tokens: int | None) -> int | None:
    """As given; for a cache smaller than the model's context, the cache's size.

    vLLM refuses to start when one request of the model's full length would not fit in the KV
    cache, which the pressure presets' cache is made too small for on purpose.
    """
    if options.max_model_len is not None or kv_tokens is None:
        return options.max_model_len
    try:
        config = json.loads((model_dir / "config.json").read_text())
        positions = int(config["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return kv_tokens
    return min(positions, kv_tokens)


def run_bench(options: BenchOptions, command: list[str], console: Console,
              out_console: Console) -> bool:
    """Run the benchmark the options describe; True if at least one mode ran to the end.

    Raises `PlanError` before anything starts when an option cannot work.
    """
    _check(options)
    modes = parse_modes(options.modes)
    baseline = pick_baseline(modes, options.baseline)
    model_dir = _model_dir(options)
    count_tokens = _token_counter(model_dir)
    kv_bytes, kv_tokens = _kv_cache_bytes(options, model_dir)
    workload = build_workload(options.workload, seed=options.seed, sessions=options.sessions,
                              concurrency=options.concurrency, trace=options.trace,
                              kv_cache_tokens=kv_tokens, count_tokens=count_tokens)
    bound_bytes = (_bound_kv_cache_bytes(options, model_dir, kv_bytes, workload, count_tokens)
                   if "bound" in map(tagged_mode, modes) else None)
    tier_blocks = (_tier_host_blocks(options, model_dir, kv_bytes, workload, count_tokens)
                   if any(map(has_host_tier, modes)) else None)
    settings = BenchSettings(model=options.model, dtype=options.dtype, kv_cache_bytes=kv_bytes,
                             max_model_len=_max_model_len(options, model_dir, kv_tokens),
                             block_size=options.block_size,
                             kv_recompute_threshold=options.kv_recompute_threshold,
                             short_delta_tokens=options.short_delta_tokens,
                             itl_target_ms=options.itl_target_ms,
                             bound_kv_cache_bytes=bound_bytes, tier_host_blocks=tier_blocks,
                             turn_timeout_s=options.turn_timeout,
                             stall_timeout_s=options.stall_timeout)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = options.out or Path("turnkv-bench") / f"{workload.name}-{stamp}"
    turns = sum(len(s.turns) for s in workload.sessions)
    loop = (f"{workload.concurrency} at a time" if workload.concurrency
            else "open loop by start time")
    console.print(
        f"workload [bold]{workload.name}[/] (seed {workload.seed}): "
        f"{len(workload.sessions)} sessions, {turns} turns, {loop}, about "
        f"{total_context_tokens(workload, count_tokens):,} context tokens; "
        f"modes {', '.join(modes)}"
        + (f", each {options.repeat} times, interleaved; " if options.repeat > 1 else "; ") +
        f"output in {out}")
    runner = Runner(workload, settings, out, console=console)
    result = runner.run(modes, baseline, command, repeat=options.repeat)
    paths = write_outputs(result, out)
    out_console.print(report.rich_table(result))
    for path in paths:
        out_console.print(f"wrote {path}")
    return any(run.status.state == "ok" for run in result.runs)
