"""Local text that workloads are made of: files every install has.

Two sources, none downloaded: the package's own `data/tiny_corpus.txt` (prose) and the `.py`
files of Python's standard library (code, for the outputs of file-reading and search tools).
Files are taken in sorted order so that one seed gives one workload on one install; the standard
library differs between Python versions, so save a workload with `trace.write_trace` to replay
it elsewhere. (The checkout's `docs/*.md` were prose too once: every edit of the docs then
changed the benchmark's workload, 58, 57 and 56 turns of `agent-pressure` at three commits.)
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# Enough variety for thousands of tool results, while loading in well under a second.
MAX_CODE_FILES = 120
MAX_FILE_LINES = 2000
_WORD = re.compile(r"\b[a-z]{4,12}\b")
_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{4,30}\b")


@dataclass(frozen=True)
class SourceFile:
    """One text file: the path a tool would show, its lines, and the lines joined."""

    path: str
    lines: tuple[str, ...]
    # Kept whole so that a search skips a file with one substring test, not a loop of lines.
    text: str


@dataclass(frozen=True)
class Corpus:
    """Prose files, code files, and the words and identifiers found in them."""

    prose: tuple[SourceFile, ...]
    code: tuple[SourceFile, ...]
    words: tuple[str, ...]
    identifiers: tuple[str, ...]

    @property
    def files(self) -> tuple[SourceFile, ...]:
        """Every file, prose first."""
        return self.prose + self.code


def stdlib_dir() -> Path:
    """The folder of the standard library's `.py` files."""
    source = inspect.getsourcefile(json)
    if source is None:
        raise RuntimeError("the standard library has no source files in this Python")
    return Path(source).resolve().parent.parent


def load_corpus(max_code_files: int = MAX_CODE_FILES) -> Corpus:
    """Read the local sources."""
    tiny = resources.files("turnkv_server") / "data" / "tiny_corpus.txt"
    prose = [_source("data/tiny_corpus.txt", tiny.read_text(encoding="utf-8"))]
    code_paths = sorted(stdlib_dir().glob("*.py"))[:max_code_files]
    code = [_source(f"lib/{p.name}", p.read_text(encoding="utf-8", errors="replace"))
            for p in code_paths]
    prose = [f for f in prose if f.lines]
    code = [f for f in code if f.lines]
    if not code:
        raise RuntimeError(f"no .py files found in {stdlib_dir()}")
    prose_text = "\n".join(line for f in prose for line in f.lines)
    code_text = "\n".join(line for f in code for line in f.lines)
    return Corpus(prose=tuple(prose), code=tuple(code),
                  words=_distinct(_WORD.findall(prose_text.lower())),
                  identifiers=_distinct(_IDENT.findall(code_text)))


def _source(path: str, text: str) -> SourceFile:
    lines = tuple(line.rstrip() for line in text.splitlines()[:MAX_FILE_LINES])
    return SourceFile(path=path, lines=lines, text="\n".join(lines))


def _distinct(found: list[str]) -> tuple[str, ...]:
    # Words seen at least twice: drops one-off typos and fragments.
    seen: dict[str, int] = {}
    for word in found:
        seen[word] = seen.get(word, 0) + 1
    return tuple(sorted(w for w, n in seen.items() if n >= 2))
