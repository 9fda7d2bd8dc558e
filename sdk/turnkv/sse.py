"""An incremental reader of server-sent events: bytes in, `data` payloads out."""

from __future__ import annotations


class SSEReader:
    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return events
            line = self._buffer[:cut].rstrip(b"\r").decode("utf-8", "replace")
            self._buffer = self._buffer[cut + 1:]
            self._line(line, events)

    def close(self) -> list[str]:
        events: list[str] = []
        if self._buffer:
            self._line(self._buffer.rstrip(b"\r").decode("utf-8", "replace"), events)
            self._buffer = b""
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
