"""The agent's tools: list, read and search the text files of one folder.

Every tool is bounded (entries, characters, hits), so that one call cannot flood a small
model's context, and sandboxed: a path that leaves the folder is refused. A tool's failure is a
`ToolError`, whose message goes back to the model as the tool's result.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class ToolError(Exception):
    """The call cannot be served; the message is written for the model."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    params: tuple[str, ...]  # positional, in the order of the textual format
    required: int  # how many of `params` must be given
    description: str
    example: str

    def usage(self) -> str:
        args = " ".join(f"<{p}>" if i < self.required else f"[{p}]"
                        for i, p in enumerate(self.params))
        return f"CALL {self.name} {args}"

    def json_schema(self) -> dict[str, object]:
        """The OpenAI `tools` entry, for servers that return `tool_calls`."""
        props = {p: {"type": "integer" if p == "line" else "string"} for p in self.params}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": props,
                           "required": list(self.params[: self.required])}}}


SPECS = (
    ToolSpec("list_files", ("folder",), 0, "list the files under a folder", "CALL list_files ."),
    ToolSpec("read_file", ("path", "line"), 1,
             "show a file, from line 1 or from the given line", "CALL read_file install.md"),
    ToolSpec("search", ("pattern",), 1,
             "show the lines of all files that match a word or regex", "CALL search lease"),
)


class FolderTools:
    def __init__(self, root: Path, *, max_chars: int = 1500, max_hits: int = 12,
                 max_entries: int = 100) -> None:
        self.root = root.resolve()
        if not self.root.is_dir():
            raise ValueError(f"{root} is not a folder")
        self.max_chars = max_chars
        self.max_hits = max_hits
        self.max_entries = max_entries
        self.specs = {spec.name: spec for spec in SPECS}

    def run(self, name: str, args: dict[str, object]) -> str:
        spec = self.specs.get(name)
        if spec is None:
            raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(self.specs)}")
        unknown = sorted(set(args) - set(spec.params))
        if unknown:
            raise ToolError(f"{name} takes {', '.join(spec.params)}, not {', '.join(unknown)}")
        missing = [p for p in spec.params[: spec.required] if not args.get(p)]
        if missing:
            raise ToolError(f"{name} needs {', '.join(missing)}: {spec.usage()}")
        if name == "list_files":
            return self.list_files(str(args.get("folder") or "."))
        if name == "read_file":
            return self.read_file(str(args["path"]), _line(args.get("line")))
        return self.search(str(args["pattern"]))

    def files(self, folder: str = ".") -> list[str]:
        base = self._resolve(folder)
        if not base.is_dir():
            raise ToolError(f"{folder} is not a folder")
        return [str(p.relative_to(self.root)) for p in _text_files(base)]

    def list_files(self, folder: str = ".") -> str:
        names = self.files(folder)
        if not names:
            return f"{folder}: no text files"
        shown = names[: self.max_entries]
        more = f"\n... and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
        return "\n".join(shown) + more

    def read_file(self, path: str, line: int = 1) -> str:
        target = self._resolve(path)
        if not target.is_file():
            hint = ", ".join(self.files()[:8])
            raise ToolError(f"no file {path!r}; files here: {hint}")
        lines = _read(target).splitlines()
        if not 1 <= line <= max(1, len(lines)):
            raise ToolError(f"{path} has {len(lines)} lines; line {line} is out of range")
        out: list[str] = []
        size, end = 0, line - 1
        while end < len(lines):
            # Plain lines, no numbers in front: SmolLM2 answered "1: 1: 1: ..." after them.
            text = lines[end][: self.max_chars]
            if out and size + len(text) > self.max_chars:
                break
            out.append(text)
            size, end = size + len(text) + 1, end + 1
        if end < len(lines):
            out.append(f"[{len(lines) - end} more lines: read on from line {end + 1}]")
        return "\n".join(out) or f"{path} is empty"

    def search(self, pattern: str) -> str:
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error:
            # Models write patterns like "foo(" : take them literally rather than fail.
            regex = re.compile(re.escape(pattern), re.IGNORECASE)
        hits: list[str] = []
        total = 0
        for path in _text_files(self.root):
            for number, text in enumerate(_read(path).splitlines(), start=1):
                if regex.search(text):
                    total += 1
                    if len(hits) < self.max_hits:
                        rel = path.relative_to(self.root)
                        hits.append(f"{rel}:{number}: {text.strip()[:160]}")
        if not hits:
            return f"no line matches {pattern!r}"
        more = f"\n... {total - len(hits)} more matches" if total > len(hits) else ""
        return "\n".join(hits) + more

    def _resolve(self, path: str) -> Path:
        cleaned = path.strip().strip("`'\"")
        target = (self.root / cleaned).resolve()
        if target != self.root and self.root not in target.parents:
            raise ToolError(f"{path!r} is outside the folder")
        return target


def _line(value: object) -> int:
    if value is None or value == "":
        return 1
    try:
        return int(str(value))
    except ValueError:
        raise ToolError(f"line must be a number, not {value!r}") from None


def _text_files(base: Path) -> Iterator[Path]:
    for path in sorted(base.rglob("*")):
        rel_parts = path.relative_to(base).parts
        hidden = any(part.startswith(".") for part in rel_parts)
        if path.is_file() and not hidden and _is_text(path):
            yield path


def _is_text(path: Path) -> bool:
    with path.open("rb") as handle:
        return b"\0" not in handle.read(4096)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
