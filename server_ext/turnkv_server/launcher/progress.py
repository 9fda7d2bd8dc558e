"""What each engine is doing while it starts, read from its log, shown as it changes.

An engine takes from half a minute to a few minutes to become healthy (on a busy 2-core
host, two engines at once: about two minutes), all of it spent inside vLLM. Its log says what
it is doing: vLLM writes a known line as it reaches each step (configuration read, engine core
started, weights loaded, KV cache sized and allocated, API server up). `LogPhases` follows one
engine's log from where this start began and names the furthest step it has reached;
`StartupDisplay` shows every engine's step and seconds so far: a live line per engine on a
terminal, and on anything else (a pipe, a log file, CI) one line per change, plus a "still"
line when a step lasts, so that a log never goes quiet for long.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn


@dataclass(frozen=True)
class Phase:
    marker: re.Pattern[str]
    words: str  # `{0}`: the marker's first group


# Before its first line an engine imports torch and vLLM (seconds, even on an idle core).
STARTING = "importing vLLM"
# In the order an engine reaches them; a step's line may be missing (no KV connector in
# single mode), so an engine is at the furthest step whose line has appeared.
PHASES: tuple[Phase, ...] = (
    Phase(re.compile(r"non-default args:"), "reading the model's configuration"),
    Phase(re.compile(r"Initializing a V1 LLM engine"), "starting the engine core"),
    Phase(re.compile(r"Starting to load model"), "loading the weights"),
    Phase(re.compile(r"Loading weights took ([\d.]+) ?s"),
          "weights loaded in {0} s; sizing the KV cache"),
    Phase(re.compile(r"KV cache size: ([\d,]+) tokens"),
          "KV cache allocated ({0} tokens); warming up"),
    Phase(re.compile(r"Initialized NIXL agent|KV blocks of \d+ bytes registered"),
          "KV connector (NIXL) ready; warming up"),
    Phase(re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"),
          "engine ready; starting its API server"),
    Phase(re.compile(r"Starting vLLM server on|Application startup complete"),
          "API server up; waiting for /health"),
)
# Bytes read per poll at most: a log grows by a few KB a second while an engine starts.
READ_CHUNK = 1 << 20
# Without a live line, how often a step that lasts is reported again.
STILL_EVERY_S = 30.0


class LogPhases:
    """The furthest start-up step an engine's log shows, read incrementally from `offset`
    (where this start began: a restarted engine appends to its old log)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self._position = offset
        self._partial = b""
        self.index = -1
        self.words = STARTING

    def poll(self) -> str:
        try:
            with open(self.path, "rb") as log:
                log.seek(self._position)
                data = log.read(READ_CHUNK)
        except OSError:
            return self.words  # not created yet
        self._position += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._take(line.decode("utf-8", errors="replace"))
        return self.words

    def _take(self, line: str) -> None:
        for index in range(len(PHASES) - 1, self.index, -1):
            match = PHASES[index].marker.search(line)
            if match:
                self.index = index
                self.words = PHASES[index].words.format(*match.groups())
                return


class StartupDisplay:
    """Every starting engine's step and seconds so far, on `console`."""

    def __init__(self, console: Console, names: list[str], *, live: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.live = console.is_terminal if live is None else live
        self._clock = clock
        self._said: dict[str, tuple[str, float]] = {}  # name -> (words, when said)
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        width = max((len(n) for n in names), default=0)
        self._label = {n: n.ljust(width) for n in names}
        if self.live:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                      console=console, transient=False)
            for name in names:
                self._tasks[name] = self._progress.add_task(self._line(name, STARTING, 0))

    def __enter__(self) -> StartupDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, name: str, words: str, elapsed_s: float) -> None:
        """`name` is at step `words`, `elapsed_s` seconds after it started."""
        if self._progress is not None:
            self._progress.update(self._tasks[name],
                                  description=self._line(name, words, elapsed_s))
            return
        said = self._said.get(name)
        now = self._clock()
        if said is not None and said[0] == words:
            if now - said[1] < STILL_EVERY_S:
                return
            words = f"still {words}"
        self.console.print(self._line(name, words, elapsed_s), highlight=False)
        self._said[name] = (words.removeprefix("still "), now)

    def serving(self, name: str, url: str, elapsed_s: float) -> None:
        words = f"[green]serving on {escape(url)}[/]"
        if self._progress is not None:
            self._progress.update(self._tasks[name], completed=1, total=1,
                                  description=self._line(name, words, elapsed_s, markup=True))
            self._progress.stop_task(self._tasks[name])
            return
        self.console.print(self._line(name, words, elapsed_s, markup=True), highlight=False)

    def _line(self, name: str, words: str, elapsed_s: float, markup: bool = False) -> str:
        text = words if markup else escape(words)
        return f"  {escape(self._label.get(name, name))}  {text} [dim]({elapsed_s:.0f} s)[/]"
