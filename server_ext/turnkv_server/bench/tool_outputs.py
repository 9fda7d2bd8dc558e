"""Tool results shaped like the outputs of an agent's list, read and search tools.

Agents mostly look at code: a file listing with sizes, a file excerpt with line numbers, grep
hits as `path:line:text`. Each output is built from corpus files and cut to a token budget the
way real tools truncate long output. Each generator below is endless, so any budget fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from turnkv_server.bench.corpus import Corpus, SourceFile
from turnkv_server.bench.sizing import TokenCounter, take_tokens

TOOLS = ("list_files", "read_file", "search")
# Reading dominates agent traces; listings are rarer and come early.
TOOL_WEIGHTS = (0.2, 0.5, 0.3)
# Listings repeat the corpus under these folders once its own names run out.
_FOLDERS = ("src", "tests", "tools", "vendor", "build/lib")


def tool_output(rng: np.random.Generator, corpus: Corpus, target: int,
                count: TokenCounter) -> str:
    """One tool's output of `target` tokens, the tool drawn by `TOOL_WEIGHTS`."""
    tool = TOOLS[int(rng.choice(len(TOOLS), p=TOOL_WEIGHTS))]
    if tool == "list_files":
        return take_tokens(_listing(rng, corpus), target, count)
    if tool == "read_file":
        return take_tokens(_excerpt(rng, corpus), target, count)
    return take_tokens(_grep(rng, corpus), target, count)


def _listing(rng: np.random.Generator, corpus: Corpus) -> Iterator[str]:
    folder = _FOLDERS[int(rng.integers(len(_FOLDERS)))]
    yield f"list_files {folder}:"
    files = corpus.files
    for round_ in itertools.count():
        prefix = "" if round_ == 0 else f"{_FOLDERS[round_ % len(_FOLDERS)]}/"
        for i in rng.permutation(len(files)):
            f = files[int(i)]
            yield f"{len(f.text) + 1:>9,}  {len(f.lines):>6} lines  {prefix}{f.path}"


def _excerpt(rng: np.random.Generator, corpus: Corpus) -> Iterator[str]:
    # Code three times in four: agents read source more than prose.
    while True:
        pool = corpus.code if rng.random() < 0.75 else corpus.prose
        f = pool[int(rng.integers(len(pool)))]
        start = int(rng.integers(len(f.lines)))
        yield f"read_file {f.path} (from line {start + 1} of {len(f.lines)}):"
        for number in range(start, len(f.lines)):
            yield f"{number + 1:>5}  {f.lines[number]}"


def _grep(rng: np.random.Generator, corpus: Corpus) -> Iterator[str]:
    # Search for identifiers the code really contains, so that hits exist; when one search
    # runs out of hits the output continues with the next, as a batch of searches would.
    while True:
        pattern = corpus.identifiers[int(rng.integers(len(corpus.identifiers)))]
        yield f"search {pattern}:"
        files = corpus.files
        for i in rng.permutation(len(files)):
            yield from _hits(files[int(i)], pattern)


def _hits(f: SourceFile, pattern: str) -> Iterator[str]:
    if pattern not in f.text:
        return
    for number, line in enumerate(f.lines, start=1):
        if pattern in line:
            yield f"{f.path}:{number}:{line.strip()}"
