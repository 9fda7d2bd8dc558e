"""The host tier's settings, read from `kv_connector_extra_config`, checked before vLLM reads them.

vLLM's CPU spec (upstream `vllm/v1/kv_offload/cpu/spec.py`) sizes its host buffer from
``cpu_bytes_to_use`` alone and reads ``offload_prompt_only`` with ``bool(...)``, so the string
``"false"`` turns it on, and it defaults to true, which never offloads a reply (an agent's next
turn starts with it). Here:

- the host buffer is sized by exactly one of ``cpu_bytes_to_use`` (bytes, vLLM's own key) or
  ``host_blocks`` (engine KV blocks: what an operator counts against the engine's own cache);
- ``offload_prompt_only`` defaults to false and must be a JSON boolean;
- what the host copy does not implement is refused by name: ``canonical_layout`` (the copy keeps
  the engine's own page bytes) and more than one worker (turnkv's connector refuses TP/PP above 1
  too, and nothing here was run with more).

The result is an `extra_config` vLLM's spec reads unchanged (``cpu_bytes_to_use`` set to the
bytes that give exactly the chunks asked for), plus the chunk count, so the spec can check that
vLLM's own sizing arithmetic still agrees.

The disk tier below it (`disk`, a secondary tier of vLLM's tiering manager) takes its settings
as keyword arguments from its ``secondary_tiers`` entry; `resolve_disk` checks them the same
way: ``root_dir`` and ``max_bytes`` required, ``max_bytes`` a positive integer that holds at
least one chunk, thread counts positive integers.

Standard library only: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HOST_BYTES_KEY = "cpu_bytes_to_use"  # vLLM's key (upstream cpu/spec.py)
HOST_BLOCKS_KEY = "host_blocks"  # ours
PROMPT_ONLY_KEY = "offload_prompt_only"  # vLLM's key (upstream kv_offload/base.py)
CANONICAL_KEY = "canonical_layout"  # vLLM's key (upstream offloading/config.py)


class TierSettingsError(ValueError):
    """A setting of the host or disk tier that cannot serve; the message names the key and the
    fix."""


@dataclass(frozen=True)
class TierSettings:
    """What the host tier was asked for, resolved against one engine's KV geometry."""

    num_chunks: int  # offload chunks the host buffer holds
    blocks_per_chunk: int  # engine blocks per chunk (vLLM's `block_size`/`blocks_per_chunk`)
    chunk_bytes: int  # host bytes per chunk, page-aligned as vLLM's spec aligns them
    offload_prompt_only: bool

    @property
    def host_blocks(self) -> int:
        """Engine blocks the host buffer holds."""
        return self.num_chunks * self.blocks_per_chunk

    @property
    def host_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes


def _positive_int(extra: Mapping[str, Any], key: str) -> int:
    value = extra[key]
    # bool is an int in Python: `true` must not read as one byte or one block.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TierSettingsError(
            f"{key} must be a positive integer, got {value!r} ({type(value).__name__})"
        )
    if value <= 0:
        raise TierSettingsError(f"{key} must be a positive integer, got {value}")
    return value


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def resolve(
    extra: Mapping[str, Any],
    *,
    kv_bytes_per_block: int,
    blocks_per_chunk: int,
    alignment: int,
    world_size: int,
) -> TierSettings:
    """Check the settings and size the host buffer for an engine whose KV block (all layers,
    this worker) is `kv_bytes_per_block` bytes; `alignment` is the host chunk alignment vLLM's
    spec applies (its `BLOCK_SIZE_ALIGNMENT`, the page size). A `kv_bytes_per_block` of 0 means
    vLLM has no KV geometry yet (its spec then sizes zero chunks): only the keys are checked."""
    if world_size != 1:
        raise TierSettingsError(
            f"the host tier serves one worker per engine (world size {world_size}): "
            "tensor or pipeline parallelism is not supported here"
        )
    if extra.get(CANONICAL_KEY):
        raise TierSettingsError(
            f"{CANONICAL_KEY} is not supported by the host tier: it stores the engine's own "
            f"page bytes; remove {CANONICAL_KEY} from kv_connector_extra_config"
        )
    prompt_only = extra.get(PROMPT_ONLY_KEY, False)
    if not isinstance(prompt_only, bool):
        raise TierSettingsError(
            f"{PROMPT_ONLY_KEY} must be true or false (a JSON boolean), got {prompt_only!r}; "
            "leave it false for agents, or replies are never offloaded"
        )
    has_bytes, has_blocks = HOST_BYTES_KEY in extra, HOST_BLOCKS_KEY in extra
    if has_bytes == has_blocks:
        raise TierSettingsError(
            f"size the host tier with exactly one of {HOST_BYTES_KEY} (bytes) or "
            f"{HOST_BLOCKS_KEY} (engine KV blocks); got "
            + ("both" if has_bytes else "neither")
        )
    if blocks_per_chunk <= 0:
        raise TierSettingsError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    if alignment <= 0 or kv_bytes_per_block < 0:
        raise TierSettingsError(
            f"bad KV geometry: alignment {alignment}, {kv_bytes_per_block} bytes per block"
        )

    chunk_bytes = _round_up(kv_bytes_per_block * blocks_per_chunk, alignment)
    if has_blocks:
        blocks = _positive_int(extra, HOST_BLOCKS_KEY)
        if blocks % blocks_per_chunk:
            raise TierSettingsError(
                f"{HOST_BLOCKS_KEY}={blocks} is not a multiple of the {blocks_per_chunk} engine "
                f"blocks per offload chunk; use {_round_up(blocks, blocks_per_chunk)}"
            )
        num_chunks = blocks // blocks_per_chunk
    else:
        host_bytes = _positive_int(extra, HOST_BYTES_KEY)
        num_chunks = host_bytes // chunk_bytes if chunk_bytes else 0
    if kv_bytes_per_block == 0:
        num_chunks = 0  # vLLM's own spec sizes nothing without a geometry (upstream cpu/spec.py)
    elif num_chunks == 0:
        raise TierSettingsError(
            f"the host tier holds less than one offload chunk ({chunk_bytes} bytes: "
            f"{blocks_per_chunk} engine block(s) of {kv_bytes_per_block} bytes); "
            f"raise {HOST_BYTES_KEY if has_bytes else HOST_BLOCKS_KEY}"
        )
    return TierSettings(
        num_chunks=num_chunks,
        blocks_per_chunk=blocks_per_chunk,
        chunk_bytes=chunk_bytes,
        offload_prompt_only=prompt_only,
    )


def vllm_extra_config(extra: Mapping[str, Any], settings: TierSettings) -> dict[str, Any]:
    """`extra` as vLLM's CPU spec reads it: the host size in its own key and unit (bytes that
    divide into exactly `settings.num_chunks` chunks) and the resolved `offload_prompt_only`."""
    resolved = dict(extra)
    # vLLM refuses a zero or missing size even when it will size zero chunks; any positive
    # value then gives zero chunks, as `resolve` decided.
    resolved[HOST_BYTES_KEY] = settings.host_bytes or 1
    resolved[PROMPT_ONLY_KEY] = settings.offload_prompt_only
    return resolved


DISK_ROOT_KEY = "root_dir"
DISK_MAX_BYTES_KEY = "max_bytes"
DISK_READ_THREADS_KEY = "n_read_threads"
DISK_WRITE_THREADS_KEY = "n_write_threads"


@dataclass(frozen=True)
class DiskTierSettings:
    """What the disk tier was asked for, checked against the host tier's chunk size."""

    root_dir: str
    max_bytes: int
    read_threads: int
    write_threads: int


def resolve_disk(
    root_dir: object, max_bytes: object, read_threads: object, write_threads: object, *,
    chunk_bytes: int,
) -> DiskTierSettings:
    """Check the disk tier's settings; `chunk_bytes` is one host chunk (one file)."""
    if not isinstance(root_dir, str) or not root_dir:
        raise TierSettingsError(
            f"the disk tier needs {DISK_ROOT_KEY}, a directory path it owns, got {root_dir!r}"
        )
    if max_bytes is None:
        raise TierSettingsError(
            f"the disk tier needs {DISK_MAX_BYTES_KEY}, its size bound in bytes"
        )
    values = {DISK_MAX_BYTES_KEY: max_bytes, DISK_READ_THREADS_KEY: read_threads,
              DISK_WRITE_THREADS_KEY: write_threads}
    bound, reads, writes = (_positive_int(values, key) for key in values)
    if bound < chunk_bytes:
        raise TierSettingsError(
            f"{DISK_MAX_BYTES_KEY}={bound} holds no chunk of the host tier ({chunk_bytes} "
            f"bytes each); raise {DISK_MAX_BYTES_KEY}"
        )
    return DiskTierSettings(root_dir=root_dir, max_bytes=bound, read_threads=reads,
                            write_threads=writes)
