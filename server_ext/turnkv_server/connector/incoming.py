"""The receiving end's transfers (one `IncomingTransfer` per transfer ID) and its timing.

`receiving.Receiving` runs the protocol (commands, side-channel messages, notifications,
deadlines); what it knows of each receive lives here (the connections to senders are in
`sender_links`). No socket and no NIXL call here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A sender's last write carries this, then the transfer ID; NIXL hands it to the receiver
# with the name of the agent that wrote.
NOTIF_PREFIX = b"turnkv:"
# A pending sender's pongs keep its receives alive this long each.
SILENCE_S = 5.0
# While only given-up receives wait for a notification, NIXL's are read this often: nothing
# but their blocks' return waits on it, and the transfer thread may sleep meanwhile.
SLOW_NOTIFICATIONS_S = 1.0


@dataclass
class IncomingTransfer:
    request_id: str
    transfer_id: str
    peer: str
    blocks: list[int]
    first_block: int
    tokens: int
    digest: bytes
    timeout_s: float
    started: float
    deadline: float
    # The sender agent the registration went to; None while it has not left this engine.
    # Only that agent's notification completes the receive.
    registered_with: str | None = None
    # When this engine last told the sender it wants the transfer (registration or ping).
    last_wanted: float = -math.inf
    retried: bool = False
    # Set once given up (quarantined): why, when its blocks may go back into use, and whether
    # that is the grace after the sender's word (`drain`) rather than the long bound.
    giving_up: str | None = None
    release_at: float = math.inf
    drained: bool = False
    # The sender said a write of it may still land (NIXL failed it, or would not release
    # it): only its notification, or the sender's process being gone, drains it early.
    writes_may_land: bool = False

    def drain(self, now: float, grace_s: float, sender_gone: bool = False) -> None:
        """The sender settled the transfer's writes (or its process is gone): the blocks go
        back once what the connection still carried has landed."""
        if self.writes_may_land and not sender_gone:
            return
        if not self.drained:
            self.drained, self.release_at = True, now + grace_s
