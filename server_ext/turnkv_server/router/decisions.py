"""The planner's terms, plain data: what it knows of a turn (`TurnFacts`), the placements it
weighs (`CHOICES`) and what it decides (`Decision`), what it keeps of a session between its
turns (`SessionPlace`), and the costs it assumes before an engine has measured any (`Priors`).
The planner (`router.planner`, with its weighing, `router.weighing`) reads and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Where a turn runs, and what moves:
# - "whole": the home computes what it lacks of the prompt and decodes, as an aggregated engine
#   would. Nothing moves; but the home's other requests get no token while it computes. (A home
#   that lost the history to memory pressure restores what its tier holds and computes the
#   rest: still "whole".)
# - "split": the other engine (the helper) computes the prompt and writes the KV the home lacks
#   (the delta) into it, layer by layer, while the home goes on decoding its other sessions.
#   The helper computes what its own cache lacks: only the delta where it holds a copy.
# - "move": the session's home changes to the other engine: where that engine holds a copy of
#   the history, it serves the turn whole from its copy; else the KV is pulled from the old
#   home (which computes the delta and writes the whole prompt's KV), or recomputed when the
#   old home is down. Where the engines share a tier below their caches (`--shared-tier`: a
#   file tier every engine writes each block it stores to), the other engine reads the history
#   there and computes the delta: a busy home's turn goes to the idle engine for a read.
Where = Literal["whole", "split", "move"]
# The placements the planner weighs: a move either pulls the history over the link
# ("move"), goes to the copy a push back left on the other engine ("move-copy"), or has the
# other engine read it from the tier both share ("move-tier").
Choice = Literal["whole", "split", "move", "move-copy", "move-tier"]
CHOICES: tuple[Choice, ...] = ("whole", "split", "move", "move-copy", "move-tier")


@dataclass
class SessionPlace:
    """What the planner keeps of a session between its turns."""

    # The engine other than the home holding a copy of the history, and how many of its
    # leading tokens (a copy of an older history is still its prefix, edits aside).
    copy_on: str | None = None
    copy_tokens: int = 0
    history_len: int = 0  # prompt and output tokens of the last turn
    # Whether `Session.tokens` is that history (a turn served untokenized leaves it older).
    tokens_current: bool = False
    turns_since_split: int | None = None
    expected_output: float = 0.0
    # The last turn's prompt, tokens, and the size of the request that carried it (bytes of
    # its JSON): a prompt not read is estimated at the same tokens per byte.
    prompt_tokens: int = 0
    request_bytes: int = 0


@dataclass(frozen=True)
class TurnFacts:
    """What the planner knows of the turn and its session."""

    # The prompt's length (None: not tokenized; the planner asked for none, `needs_prompt`).
    prompt_tokens: int | None = None
    # Leading tokens of the prompt held by the home and by the helper.
    home_holds: int = 0
    helper_holds: int = 0
    block_size: int | None = None
    expected_output: int = 0  # tokens the turn is expected to decode
    turns_since_split: int | None = None  # None: the session never split
    # The session's history after its last turn, tokens (0: none known); what a move holds
    # where the prompt is not tokenized.
    history_tokens: int = 0
    # A prompt not read: its length estimated from its request's size (None: no estimate).
    prompt_estimate: int | None = None
    # A push back is possible: the turn's history will be known, and it is not the last.
    can_push_back: bool = False
    # The engines share a tier below their caches, and the leading tokens of the prompt it
    # holds.
    shared_tier: bool = False
    tier_holds: int = 0


@dataclass(frozen=True)
class Decision:
    """What the planner decided for one turn, and why."""

    where: Where
    home: str  # the engine that decodes the turn and holds the session after it
    prefill: str  # the engine that computes the prompt
    push_back: bool = False
    pull: bool = False  # a move that pulls the history from the old home
    pinned: bool = False
    why: str = ""
    estimates: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Priors:
    """The costs assumed before an engine has measured anything (cold start).

    The planner compares placements of one turn over the same engines, so what decides on a
    cold start is the ratio of the token counts and of the requests each placement would stall,
    which the prior's scale does not change; its scale matters only against the fixed costs of
    a split (its overhead and transfer). Both engines start equal, and a few turns replace the
    prior with what they measured. The values are those of a mid-sized model on one GPU: a
    prefill of a few thousand tokens per second with other sessions decoding beside it, a
    decode step of tens of ms, KV moving at tens of tokens per ms over the engines' link."""

    prefill_ms_per_token: float = 0.2
    decode_step_ms: float = 30.0
    transfer_tokens_per_ms: float = 50.0
    # Tokens of KV per ms an engine reads from its tier (for the shared tier, a file per
    # chunk, then a copy into its cache), until its prompts measure it.
    tier_read_tokens_per_ms: float = 40.0
    # A split's fixed cost, until one measures it: a second request, the receiver's
    # registration, the first layer's write and the home's next step.
    split_overhead_ms: float = 5.0
