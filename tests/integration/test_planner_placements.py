"""The `turnkv` mode's planner on real engines (tiny model, float32): whatever it decides, a
turn's greedy output equals a single engine's, turn by turn.

The placements are pinned (`--pin-placement`, a diagnostic option) so that each is played
where it should be: `whole` on the session's home, `split` (the other engine computes, the
home receives the KV it lacks), `move` (the session's new home pulls its history from the
old one), `move-copy` (the session moves to the engine holding a copy of its history, which
serves the turn whole), one after another in one conversation and at an edited history;
`move-tier` (the session moves to the other engine, which reads its history from the file tier
both engines share) on a pair with that tier; and unpinned, a move that recomputes because the
session's home is down. (A whole turn that restores its history from the home's tier:
test_tier.py.)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import SHORT_LEASES, TINY_ENGINES, ClusterSpec, RouterView
from tests.support.oracle import Completion, RoutedCompletion, compare, routed_chat
from tests.support.reference import ROUTER_SCRIPT, Reference, References
from tests.support.waiting import wait_for
from turnkv_server.launcher import ClusterState

SCRIPT = ROUTER_SCRIPT
SCRIPT_BLOCK = 128  # the tiny model's KV block on the CPU backend
EDITED_AT = SCRIPT.edited_at
assert EDITED_AT is not None
# Each session's turns placed as the list says: every placement after another, each with a
# history behind it (the split leaves the history on the other engine, where the move to the
# copy finds it; a whole turn with a history: the edited and home-down tests).
PINS = ("whole", "split", "move-copy", "move", "split")


def planner_view(pins: tuple[str, ...]) -> ClusterSpec:
    """A router of its own with `pins` in front of the first prefill and decode engines of the
    suite's tiny turnkv engines (no new engine set: the suite's time is spent)."""
    return ClusterSpec(f"planner-{'-'.join(pins)}", TINY_ENGINES["turnkv"], RouterView(
        prefill=1, decode=1, args=("--health-interval", "3600",
                                   "--pin-placement", ",".join(pins))))


CLUSTER = planner_view(PINS)
# At the edited turn (the third: session turn index 2), each placement in turn.
EDITED = {where: planner_view(("whole", "split", where))
          for where in ("whole", "split", "move", "move-copy")}
# On the pair sharing a file tier (test_load.py's): the session moves back and forth for a
# read of the tier, once at the edited turn.
SHARED_PINS = ("whole", "move-tier", "move-tier")
SHARED = ClusterSpec("planner-shared-tier", SHORT_LEASES, RouterView(
    prefill=1, decode=1, args=("--health-interval", "3600", "--shared-tier",
                               "--pin-placement", ",".join(SHARED_PINS))))
# Unpinned, probing the engines' health every second: a home that stops answering is seen down.
HOME_DOWN = ClusterSpec("planner-home-down", TINY_ENGINES["turnkv"], RouterView(
    prefill=1, decode=1, args=("--health-interval", "1")))


@pytest.fixture(scope="module")
def reference(tiny_references: References) -> Reference:
    return tiny_references[SCRIPT]


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


def _turn(state: ClusterState, client: httpx.Client, messages: list[dict[str, Any]],
          session_id: str, stream: bool) -> RoutedCompletion:
    # A salt per session: no other session's prefixes make a placement look right.
    return routed_chat(state.router, state.served_model_name, messages, SCRIPT.max_tokens,
                       session={"session_id": session_id}, stream=stream, client=client,
                       extra={"cache_salt": session_id})


def _check(ref: Completion | None, out: RoutedCompletion, turn: int, pin: str,
           home_before: str | None) -> str:
    """The turn equals the reference and went where it was pinned; returns its home."""
    assert ref is not None
    verdict = compare(ref, out.completion)
    stats = out.stats
    print(f"turn {turn} ({pin}): {verdict.describe()}; {stats['placement']}; "
          f"{stats['prompt_tokens']}")
    assert verdict.acceptable, f"turn {turn} ({pin}): {verdict.describe()}"
    placement = stats["placement"]
    where = pin.split("-")[0]
    assert placement is not None and placement["where"] == where and placement["pinned"]
    assert placement["pulled"] == (pin == "move"), placement
    home = placement["home"]
    assert stats["decode_node"] == home
    if pin in ("whole", "move-copy", "move-tier"):
        assert stats["prefill_node"] is None and placement["prefill"] == home
    else:
        # Another engine computed the prompt and wrote its KV into the home.
        assert stats["prefill_node"] == placement["prefill"] != home
    if pin == "move-copy":
        # The copy a push back or a split left there: not the whole history recomputed.
        assert stats["moved"] and home != home_before
        tokens = stats["prompt_tokens"]
        assert tokens["decode_computed"] < tokens["total"], tokens
    elif pin == "move-tier":
        # Not computed again: the first move's engine never held any of the session's KV
        # (its salt is its own), so what it did not compute came from the shared tier (no
        # push back left a copy); the move back finds its own blocks and the tier's.
        assert stats["moved"] and home != home_before and not placement["push_back"]
        tokens = stats["prompt_tokens"]
        assert tokens["decode_computed"] <= tokens["total"] - SCRIPT_BLOCK, tokens
    elif where == "move" and home_before is not None:
        assert stats["moved"] and placement["prefill"] == home_before != home
    elif home_before is not None:
        assert home == home_before and not stats["moved"]
    return str(home)


@pytest.mark.cluster(CLUSTER)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_every_placement_in_one_conversation_equals_a_single_engine(
    reference: Reference, clusters: ClusterPool, client: httpx.Client, stream: bool,
) -> None:
    _, state = clusters.get(CLUSTER)
    session_id = f"placements-{'sse' if stream else 'json'}"
    home: str | None = None
    for turn in range(1, SCRIPT.turns + 1):
        out = _turn(state, client, reference.messages[turn - 1], session_id, stream)
        home = _check(reference.turns[turn - 1], out, turn, PINS[(turn - 1) % len(PINS)], home)
    assert client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}").status_code == 200


@pytest.mark.parametrize("where", [pytest.param(where, marks=pytest.mark.cluster(spec))
                                   for where, spec in EDITED.items()])
def test_an_edited_history_stays_exact_in_every_placement(
    reference: Reference, clusters: ClusterPool, client: httpx.Client, where: str,
) -> None:
    _, state = clusters.get(EDITED[where])
    session_id = f"edited-{where}"
    pins = ("whole", "split", where)
    home: str | None = None
    for turn in range(1, EDITED_AT):
        out = _turn(state, client, reference.messages[turn - 1], session_id, stream=False)
        home = _check(reference.turns[turn - 1], out, turn, pins[turn - 1], home)
    assert reference.edited_messages is not None
    out = _turn(state, client, reference.edited_messages, session_id, stream=False)
    _check(reference.edited_turn, out, EDITED_AT, where, home)
    assert out.stats["prefix_break_at"] is not None
    assert client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}").status_code == 200


@pytest.mark.cluster(SHARED)
def test_a_session_moved_over_the_shared_tier_equals_a_single_engine(
    reference: Reference, clusters: ClusterPool, client: httpx.Client,
) -> None:
    """Each move reads the history the other engine lacks from the tier both write to, at
    every turn of the conversation and at an edited history (whose blocks after the edit no
    tier holds)."""
    _, state = clusters.get(SHARED)
    for session_id, edited in (("shared-tier", False), ("shared-tier-edited", True)):
        home: str | None = None
        for turn in range(1, (EDITED_AT if edited else SCRIPT.turns) + 1):
            pin = SHARED_PINS[(turn - 1) % len(SHARED_PINS)]
            if edited and turn == EDITED_AT:
                assert reference.edited_messages is not None
                out = _turn(state, client, reference.edited_messages, session_id, stream=False)
                home = _check(reference.edited_turn, out, turn, pin, home)
                assert out.stats["prefix_break_at"] is not None
            else:
                out = _turn(state, client, reference.messages[turn - 1], session_id,
                            stream=turn % 2 == 0)
                home = _check(reference.turns[turn - 1], out, turn, pin, home)
        assert client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}").status_code \
            == 200


def _healthy(state: ClusterState, client: httpx.Client) -> dict[str, bool]:
    engines = client.get(f"{state.router}/v1/turnkv/stats").json()["engines"]
    return {e["name"]: e["healthy"] for e in engines}


@pytest.mark.cluster(HOME_DOWN)
def test_a_session_whose_home_is_down_moves_and_recomputes_exactly(
    reference: Reference, clusters: ClusterPool, client: httpx.Client,
) -> None:
    """The planner, unpinned: the session's home stops answering (SIGSTOP, as a hung host),
    the router's health probe sees it down, and the next turn moves the session to the other
    engine, which recomputes the history; every turn equals a single engine's, and the
    session stays on its new home once the old one is back."""
    launched, state = clusters.get(HOME_DOWN)
    session_id = "home-down"
    home: str | None = None
    for turn in (1, 2):
        out = _turn(state, client, reference.messages[turn - 1], session_id, stream=False)
        assert compare(reference.turns[turn - 1], out.completion).acceptable
        assert out.stats["placement"]["where"] == "whole", out.stats
        home = home or out.stats["decode_node"]
        assert out.stats["decode_node"] == home
    victim = next(e for e in launched.engines if e.spec.name == home)
    os.killpg(victim.ref.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not _healthy(state, client)[str(home)], f"{home} seen down",
                 timeout=60)
        out = _turn(state, client, reference.messages[2], session_id, stream=True)
        verdict = compare(reference.turns[2], out.completion)
        placement = out.stats["placement"]
        print(f"turn 3: {verdict.describe()}; {placement}; {out.stats['prompt_tokens']}")
        assert verdict.acceptable, verdict.describe()
        assert placement["where"] == "move" and not placement["pulled"], placement
        assert placement["home"] != home and out.stats["decode_node"] == placement["home"]
        new_home = placement["home"]
    finally:
        os.killpg(victim.ref.pid, signal.SIGCONT)
    wait_for(lambda: all(_healthy(state, client).values()), "both engines healthy again",
             timeout=120)
    out = _turn(state, client, reference.messages[3], session_id, stream=False)
    assert compare(reference.turns[3], out.completion).acceptable
    assert out.stats["decode_node"] == new_home, out.stats
    assert client.delete(f"{state.router}/v1/turnkv/sessions/{session_id}").status_code == 200
