"""Which lives of each session have ended on this engine: a request of an ended life holds
nothing and renews nothing.

The router numbers each life of a session (its `epoch`: it grows each time the router opens
the session again after it ended) and every request of the session says which life it belongs
to (`engine.protocol`). A release (`final`, DELETE, the router's expiry) ends every life up to
its epoch, and this table remembers that. Without it, a request still in flight at the release
(a prefetch, a push back whose receive had begun) or one the release overtook on its way
through the API server would hold its blocks again when it ended, and the session's lease
would outlive its end until its TTL.

Bounded both ways: a release is forgotten `memory_s` after it was recorded, on the lease
table's clock (the one owner of the scheduler half's time; the operator's longest lease is
the default: a request older than that is long gone), and the oldest go first once
`max_entries` sessions are remembered. A forgotten release costs a stale request's hold
living until its TTL, as before this table; never wrong KV, which the block hashes rule out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

# Released sessions remembered at most: about 100 bytes each.
MAX_ENTRIES = 65_536


class ReleasedSessions:
    def __init__(self, clock: Callable[[], float], memory_s: float,
                 max_entries: int = MAX_ENTRIES) -> None:
        if memory_s <= 0 or max_entries < 1:
            raise ValueError("a release is remembered for a positive time, at least one")
        self._clock = clock
        self._memory_s = memory_s
        self._max_entries = max_entries
        # Session -> (the latest epoch released, when), oldest record first.
        self._released: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._released)

    def record(self, session_id: str, epoch: int) -> None:
        """The session's lives up to `epoch` have ended."""
        self._forget_old()
        known = self._released.pop(session_id, None)
        if known is not None:
            epoch = max(epoch, known[0])  # a late release of an earlier life ends nothing new
        self._released[session_id] = (epoch, self._clock())
        while len(self._released) > self._max_entries:
            self._released.popitem(last=False)

    def ended(self, session_id: str, epoch: int) -> bool:
        """Whether the session's life `epoch` has been released."""
        self._forget_old()
        known = self._released.get(session_id)
        return known is not None and epoch <= known[0]

    def _forget_old(self) -> None:
        horizon = self._clock() - self._memory_s
        released = self._released
        while released:
            oldest = next(iter(released.values()))
            if oldest[1] > horizon:
                break
            released.popitem(last=False)
