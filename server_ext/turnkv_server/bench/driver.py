"""Playing a workload against one server through the turnkv SDK, a session per `SessionSpec`.

Each session is one asyncio task: it waits for its start (open loop) or for a slot (closed
loop), then sends its turns one after another as streamed chat completions, greedy, with
the conversation growing by the turn's message and then the model's reply. Between turns it
sleeps the tool or think time. Before each turn it hints the router when the next one comes
(`next_turn_in`) and marks the last turn `final`, as an agent that knows its tool calls would.
A `<mode>-untagged` mode sends the same turns from a stock openai client instead (`untagged`):
no session named, no hints.

A turn that fails (HTTP error, a prompt too long for the model, no answer within the turn
timeout) is recorded with its error and ends its session: the conversation cannot go on
without the reply, and a retried turn would no longer be the workload's. A stall (see
`watchdog`) stops every session; the turns it cuts short are recorded with an error too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

import turnkv
from turnkv_server.bench.results import TurnRecord
from turnkv_server.bench.untagged import UntaggedSession
from turnkv_server.bench.watchdog import Watchdog
from turnkv_server.bench.workloads import SessionSpec, TurnSpec, Workload
from turnkv_server.mode_names import untagged

# Models served without tool parsers get tool results as user messages with this prefix.
TOOL_RESULT_PREFIX = "Tool result:\n"
# After a stall the cut-short sessions get this long to unwind before the servers are stopped.
UNWIND_GRACE_S = 10.0
WATCH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class DriveSettings:
    """How to send the turns: where, which model, and when to give up."""

    base_url: str
    model: str
    mode: str
    turn_timeout_s: float = 300.0
    stall_timeout_s: float = 90.0
    api_key: str = "turnkv-bench"


@dataclass
class DriveOutcome:
    """The turns played (in the order they ended) and, if the mode stalled, why."""

    records: list[TurnRecord] = field(default_factory=list)
    stall: str | None = None
    # Failures outside any turn (opening or releasing a session).
    session_errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def turn_message(spec: TurnSpec) -> dict[str, str]:
    """The chat message a turn appends: a user message, or a tool result sent as one."""
    if spec.role == "tool":
        return {"role": "user", "content": TOOL_RESULT_PREFIX + spec.user}
    return {"role": "user", "content": spec.user}


def gaps_ms(times: list[float]) -> list[float]:
    """Milliseconds between consecutive chunk arrival times (perf_counter seconds)."""
    return [round((b - a) * 1000.0, 3) for a, b in zip(times, times[1:], strict=False)]


def record_turn(mode: str, session_id: str, index: int, stats: turnkv.TurnStats | None, *,
                started_at: float, ended_at: float, chunk_times: list[float], sent: float,
                error: str | None) -> TurnRecord:
    """A `TurnRecord` from the SDK's stats of the turn and the client's own timings.

    TTFT is the SDK's (from the start of the turn's first attempt to the first content chunk);
    where the SDK has none (the stream was cut) it is the client's first chunk, if any.
    """
    ttft = stats.client_ttft_ms if stats is not None else None
    if ttft is None and chunk_times:
        ttft = round((chunk_times[0] - sent) * 1000.0, 3)
    e2e = stats.client_total_ms if stats is not None else None
    if stats is None:
        return TurnRecord(mode=mode, session_id=session_id, turn=index, ttft_ms=ttft,
                          itl_ms=gaps_ms(chunk_times), started_at=started_at,
                          ended_at=ended_at, error=error or "the turn returned no stats")
    tokens = stats.prompt_tokens
    return TurnRecord(
        mode=mode, session_id=session_id, turn=index,
        prompt_tokens=tokens.total or None,
        prefill_cached=tokens.prefill_cached,
        prefill_received=tokens.prefill_received,
        prefill_computed=tokens.prefill_computed,
        prefill_reused=tokens.prefill_reused,
        decode_computed=tokens.decode_computed,
        completion_tokens=stats.completion_tokens,
        kv_to_decode_bytes=stats.kv.to_decode_bytes,
        kv_to_prefill_bytes=stats.kv.to_prefill_bytes,
        ttft_ms=ttft, itl_ms=gaps_ms(chunk_times), e2e_ms=e2e,
        prefill_phase_ms=stats.times.prefill_ms if stats.served_by_turnkv else None,
        router_ttft_ms=stats.times.first_token_ms if stats.served_by_turnkv else None,
        plan_ms=stats.times.plan_ms if stats.served_by_turnkv else None,
        engine_prefill_ms=stats.times.engine_prefill_ms,
        fallback=stats.fallback, prefix_break_at=stats.prefix_break_at,
        placement=stats.placement.where if stats.placement is not None else None,
        placement_why=stats.placement.why if stats.placement is not None else None,
        prefetch=stats.prefetch, prefill_node=stats.prefill_node, decode_node=stats.decode_node,
        started_at=started_at, ended_at=ended_at, error=error,
    )


class Driver:
    """Plays one workload once; `run()` returns the outcome, never hangs past a stall."""

    def __init__(self, workload: Workload, settings: DriveSettings,
                 on_turn: Callable[[TurnRecord], None] = lambda _: None,
                 stop_servers: Callable[[], None] | None = None) -> None:
        self.workload = workload
        self.settings = settings
        self.on_turn = on_turn
        # Called (in a thread) when cut-short sessions do not unwind: a deadlocked server can
        # leave their HTTP requests waiting; stopping it makes them fail.
        self.stop_servers = stop_servers
        self.watchdog = Watchdog(settings.stall_timeout_s)
        self.outcome = DriveOutcome()
        self._stop_reason: str | None = None

    async def run(self) -> DriveOutcome:
        plain = untagged(self.settings.mode)
        client = (openai.AsyncOpenAI if plain else turnkv.AsyncOpenAI)(
            base_url=self.settings.base_url + "/v1", api_key=self.settings.api_key,
            max_retries=0)
        slots = (asyncio.Semaphore(self.workload.concurrency)
                 if self.workload.concurrency else None)
        started = time.perf_counter()
        with warnings.catch_warnings():
            # `single` is a plain vLLM server: the SDK's one warning about it is expected.
            warnings.simplefilter("ignore", turnkv.PlainServerWarning)
            tasks = [asyncio.create_task(self._session(client, spec, slots, started))
                     for spec in self.workload.sessions]
            watcher = asyncio.create_task(self._watch(tasks))
            # Ends when every session has, or when the watcher has dealt with a stall: then
            # sessions that still have not unwound are abandoned rather than waited for.
            running: set[asyncio.Task[None]] = set(tasks)
            while running and not watcher.done():
                # Only unfinished tasks: a finished one would make every wait return at once.
                await asyncio.wait([*running, watcher], return_when=asyncio.FIRST_COMPLETED)
                running = {t for t in running if not t.done()}
            if self.outcome.stall is None:
                watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(Exception):
                await client.close()
        self.outcome.wall_s = time.perf_counter() - started
        return self.outcome

    async def _watch(self, tasks: list[asyncio.Task[None]]) -> None:
        while not self.watchdog.stalled():
            await asyncio.sleep(WATCH_INTERVAL_S)
        wd = self.watchdog
        done = len(self.outcome.records)
        self._stop_reason = (
            f"no output token for {wd.silent_for():.0f} s with {wd.in_flight} turn(s) in "
            f"flight, after {done} turn(s); stopped")
        self.outcome.stall = self._stop_reason
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=UNWIND_GRACE_S)
        if pending and self.stop_servers is not None:
            await asyncio.to_thread(self.stop_servers)
            await asyncio.wait(pending, timeout=UNWIND_GRACE_S)

    async def _session(self, client: openai.AsyncOpenAI, spec: SessionSpec,
                       slots: asyncio.Semaphore | None, started: float) -> None:
        delay = started + spec.start_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        slot = slots if slots is not None else contextlib.nullcontext()
        try:
            if not isinstance(client, turnkv.AsyncOpenAI):
                async with slot:
                    await self._turns(UntaggedSession(client), spec)
                return
            async with slot, client.session(timeout=self.settings.turn_timeout_s) as session:
                await self._turns(session, spec)
        except Exception as exc:
            self.outcome.session_errors.append(f"{spec.session_id}: {type(exc).__name__}: {exc}")

    async def _turns(self, session: turnkv.AsyncSession | UntaggedSession,
                     spec: SessionSpec) -> None:
        """The session's turns in order, until the last or the first that fails."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": spec.system}]
        for index, turn in enumerate(spec.turns):
            if turn.think_time_s > 0:
                await asyncio.sleep(turn.think_time_s)
            messages.append(turn_message(turn))
            if index + 1 < len(spec.turns):
                session.hint(next_turn_in=spec.turns[index + 1].think_time_s)
            else:
                session.hint(final=True)
            reply = await self._turn(session, spec.session_id, index, messages, turn)
            if reply is None:
                return
            messages.append({"role": "assistant", "content": reply})

    async def _turn(self, session: turnkv.AsyncSession | UntaggedSession, session_id: str,
                    index: int, messages: list[dict[str, Any]], spec: TurnSpec) -> str | None:
        """Send one turn; record it; its reply, or None when the session must stop."""
        chunk_times: list[float] = []
        stream: Any = None
        stats: turnkv.TurnStats | None = None
        reply: str | None = None
        error: str | None = None
        started_at = time.time()
        sent = time.perf_counter()
        self.watchdog.turn_started()
        try:
            async with asyncio.timeout(self.settings.turn_timeout_s):
                stream = await session.stream(messages=messages, model=self.settings.model,
                                              max_tokens=spec.max_tokens, temperature=0)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        chunk_times.append(time.perf_counter())
                        self.watchdog.progress()
                turn = stream.turn
            if turn is None:
                error = "the stream ended without a complete turn"
            else:
                stats, reply = turn.stats, turn.text
        except TimeoutError:
            error = f"no complete answer within {self.settings.turn_timeout_s:g} s (turn timeout)"
        except asyncio.CancelledError:
            error = f"cut short: {self._stop_reason or 'cancelled'}"
            raise
        except Exception as exc:  # any failure is this turn's result; the run goes on
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.watchdog.turn_ended()
            if error is None:
                self.watchdog.progress()
            if stream is not None and stats is None:
                with contextlib.suppress(Exception):
                    await stream.close()
            record = record_turn(self.settings.mode, session_id, index, stats,
                                 started_at=started_at, ended_at=time.time(),
                                 chunk_times=chunk_times, sent=sent, error=error)
            self.outcome.records.append(record)
            self.on_turn(record)
        return reply if error is None else None
