from __future__ import annotations

import pytest

from turnkv.protocol import CacheHints, TurnTag
from turnkv_server.engine.requests import PREFILL_FOR_REMOTE_DECODE, prefill_request
from turnkv_server.router.apis.chat import strip_token_ids
from turnkv_server.router.app import extract_tag
from turnkv_server.router.engines import EnginePool
from turnkv_server.router.errors import BadRequest
from turnkv_server.router.modes.base import NixlPeer
from turnkv_server.router.modes.bidirectional import trim_offer
from turnkv_server.router.sessions import LeasePolicy, SessionKey, SessionTable
from turnkv_server.router.tenants import DEFAULT_TENANT, Tenants
from turnkv_server.router.token_history import common_prefix_len, prefix_break


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- history -------------------------------------------------------------------------------

def test_prefix_break_finds_the_first_divergence() -> None:
    history = list(range(1000))
    assert prefix_break(history, history + [5, 6]) is None
    assert prefix_break(history, history) is None
    edited = history[:700] + [-1] + history[701:]
    assert prefix_break(history, edited) == 700
    assert prefix_break(history, history[:300]) == 300  # a truncated resend
    assert prefix_break([], [1, 2]) is None
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2


# -- leases and the session table ----------------------------------------------------------

def test_ttl_hints_may_only_shorten_the_operator_cap() -> None:
    policy = LeasePolicy(default_ttl=300, max_ttl=900)
    assert policy.ttl(CacheHints()) == 300
    assert policy.ttl(CacheHints(ttl=60)) == 60
    assert policy.ttl(CacheHints(ttl=5000)) == 900
    assert policy.ttl(CacheHints(ttl=10, next_turn_in=100)) == 150  # outlive the tool call
    with pytest.raises(ValueError):
        LeasePolicy(default_ttl=1000, max_ttl=900)


def test_leases_expire_lazily_and_renew() -> None:
    clock = Clock()
    table = SessionTable(LeasePolicy(default_ttl=10, max_ttl=60), clock=clock)
    key = SessionKey("t", "s")
    session = table.open(key)
    table.renew(session, CacheHints(ttl=20))
    clock.now += 19
    assert table.get(key) is session
    clock.now += 2
    assert table.get(key) is None and table.expired_total == 1
    assert len(table) == 0


def test_a_session_opened_again_after_it_ended_is_a_later_life() -> None:
    """The engines tell a session's lives apart by their epochs: a release ends every life up
    to its own, so the next life's must be greater (it is the wall clock, in microseconds)."""
    clock = Clock()
    table = SessionTable(LeasePolicy(default_ttl=10, max_ttl=60), clock=clock)
    key = SessionKey("t", "s")
    first = table.open(key)
    assert table.open(key).epoch == first.epoch  # the same life
    table.release(key)
    released = table.open(key)
    assert released.epoch > first.epoch
    clock.now += 11  # expired
    assert table.open(key).epoch > released.epoch


def test_a_session_mid_turn_never_expires_or_is_evicted() -> None:
    clock = Clock()
    table = SessionTable(LeasePolicy(default_ttl=1, max_ttl=1), max_sessions=1, clock=clock)
    busy = table.open(SessionKey("t", "busy"))
    busy.in_flight = True
    clock.now += 5
    assert table.sweep() == [] and table.get(busy.key) is busy
    table.open(SessionKey("t", "other"))  # table full, only a busy session: grows by one
    assert table.get(busy.key) is busy


def test_full_table_evicts_lowest_priority_then_least_recent() -> None:
    clock = Clock()
    table = SessionTable(max_sessions=2, clock=clock)
    a = table.open(SessionKey("t", "a"))
    table.renew(a, CacheHints(priority=5))
    clock.now += 1
    b = table.open(SessionKey("t", "b"))
    table.renew(b, CacheHints(priority=0))
    clock.now += 1
    table.open(SessionKey("t", "c"))
    assert table.get(a.key) is a and table.get(b.key) is None
    assert table.evicted_total == 1


def test_sessions_are_scoped_by_tenant() -> None:
    table = SessionTable()
    mine = table.open(SessionKey("alice", "s1"))
    theirs = table.open(SessionKey("bob", "s1"))
    assert mine is not theirs and len(table) == 2


# -- placement -----------------------------------------------------------------------------

def test_placement_keeps_affinity_then_prefix_then_least_loaded() -> None:
    pool = EnginePool.from_urls(["http://p0", "http://p1"], ["http://d0", "http://d1"])
    p0, p1 = pool.prefill
    d0, d1 = pool.decode
    first = pool.place(prefill=None, decode=None, prefix_id=None)
    assert first.reason == "least_loaded"
    assert pool.place(prefill="prefill-1", decode="decode-1", prefix_id=None).reason == "affinity"
    pool.remember_prefix("sys", pool.place(prefill="prefill-1", decode="decode-0",
                                           prefix_id=None))
    warm = pool.place(prefill=None, decode=None, prefix_id="sys")
    assert (warm.prefill, warm.decode, warm.reason) == (p1, d0, "prefix_warm")
    d0.healthy = False
    moved = pool.place(prefill="prefill-1", decode="decode-0", prefix_id=None)
    assert (moved.prefill, moved.decode, moved.reason) == (p1, d1, "moved")
    p0.in_flight = 3
    assert pool.place(prefill=None, decode=None, prefix_id=None).prefill is p1
    # A warm pair whose decode engine is home to two sessions more than the other's yields.
    d0.healthy = True
    crowded = pool.place(prefill=None, decode=None, prefix_id="sys",
                         homed={"decode-0": 3, "decode-1": 1})
    assert (crowded.decode, crowded.reason) == (d1, "balanced")
    assert pool.place(prefill=None, decode=None, prefix_id="sys",
                      homed={"decode-0": 2, "decode-1": 1}).reason == "prefix_warm"


def test_round_robin_skips_unhealthy_engines() -> None:
    pool = EnginePool.from_urls(["http://p0"], ["http://d0", "http://d1", "http://d2"])
    pool.decode[1].healthy = False
    picks = [pool.round_robin().decode.name for _ in range(4)]
    assert "decode-1" not in picks and set(picks) == {"decode-0", "decode-2"}


# -- wire ----------------------------------------------------------------------------------

def test_tag_from_body_and_headers_is_validated_and_stripped() -> None:
    body = {"model": "m", "turnkv": {"session_id": "s-1", "hints": {"ttl": 30}}}
    tag = extract_tag(body, {"X-TurnKV-Priority": "2", "X-TurnKV-TTL": "99"})
    assert tag == TurnTag(session_id="s-1", hints=CacheHints(ttl=30, priority=2))
    assert "turnkv" not in body
    assert extract_tag({"model": "m"}, {}) is None
    header_only = extract_tag({}, {"X-TurnKV-Session": "abc", "X-TurnKV-Final": "true"})
    assert header_only is not None and header_only.hints.final is True


@pytest.mark.parametrize("tag, where", [
    ({"session_id": ""}, "session_id"),
    ({"session_id": "a b"}, "session_id"),
    ({"session_id": "x" * 200}, "session_id"),
    ({"session_id": "ok", "hints": {"ttl": 0}}, "hints.ttl"),
    ({"session_id": "ok", "hints": {"priority": 11}}, "hints.priority"),
    ({"session_id": "ok", "hints": {"next_turn_in": -1}}, "hints.next_turn_in"),
    ({"session_id": "ok", "turn": -1}, "turn"),
    ({"session_id": "ok", "extra": True}, "extra"),
    ({"session_id": "\u202eevil"}, "session_id"),
])
def test_bad_tags_are_rejected_with_the_field_named(tag: dict[str, object], where: str) -> None:
    with pytest.raises(BadRequest) as info:
        extract_tag({"turnkv": tag}, {})
    assert info.value.param == f"turnkv.{where}"
    assert where in info.value.message


def test_prefill_request_is_one_token_with_transfer_params() -> None:
    body = {"model": "m", "messages": [], "stream": True, "min_tokens": 3,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    out = prefill_request(body, dict(PREFILL_FOR_REMOTE_DECODE))
    assert out["max_tokens"] == 1 and out["stream"] is False and out["return_token_ids"]
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert not {"min_tokens", "stream_options", "max_completion_tokens"} & out.keys()
    assert body["stream"] is True  # the client's request is untouched


def test_token_ids_are_stripped_unless_asked_for() -> None:
    data = {"prompt_token_ids": [1], "choices": [{"token_ids": [2], "message": {}}]}
    strip_token_ids(data)
    assert data == {"choices": [{"message": {}}]}


# -- tenants -------------------------------------------------------------------------------

def test_tenants_keys_admin_and_salts() -> None:
    open_router = Tenants({})
    assert open_router.tenant_for(None) == DEFAULT_TENANT and open_router.is_admin(None)
    tenants = Tenants({"key-a": "alice", "key-b": "bob"}, admin_key="root")
    assert tenants.tenant_for("Bearer key-a") == "alice"
    assert tenants.tenant_for("Bearer nope") is None and tenants.tenant_for(None) is None
    assert tenants.is_admin("Bearer root") and not tenants.is_admin("Bearer key-a")
    salt_a, salt_b = tenants.cache_salt("alice", None), tenants.cache_salt("bob", None)
    assert salt_a != salt_b and "alice" not in salt_a
    assert tenants.cache_salt("alice", "x").endswith(":x")


def test_nixl_peer_spec() -> None:
    assert NixlPeer.parse("turnkv-prefill-0-ab@127.0.0.1:5600") == NixlPeer(
        "turnkv-prefill-0-ab", "127.0.0.1", 5600)
    with pytest.raises(ValueError, match="ENGINE_ID@HOST:PORT"):
        NixlPeer.parse("127.0.0.1:5600")


def test_kv_transfer_config_per_mode() -> None:
    from turnkv_server.launcher.cluster import kv_transfer_config

    assert kv_transfer_config("standard", "single", "x") is None
    push = kv_transfer_config("push", "prefill", "e1")
    assert push is not None and push["kv_connector"] == "NixlPushConnector"
    assert push["engine_id"] == "e1" and push["kv_role"] == "kv_producer"
    bidi = kv_transfer_config("bidirectional", "decode", "e2", decoder_kv_ttl=60)
    assert bidi is not None and bidi["kv_role"] == "kv_both"
    assert bidi["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True,
                                                 "decoder_kv_blocks_ttl": 60}


def test_a_read_back_offer_is_trimmed_to_the_shared_prefix() -> None:
    held = list(range(300))  # prompt + output the decode engine holds
    params = {"remote_num_tokens": 299, "remote_block_ids": [[7, 8, 9]], "remote_host": "h"}
    # The new prompt extends the whole history: everything but the last held token is read.
    trimmed, usable = trim_offer(params, held, held + [1, 2, 3], block_size=128)
    assert usable == 299 and trimmed["remote_block_ids"] == [[7, 8, 9]]
    # History edited at position 100: only the first block is offered, and the count with it.
    edited = held[:100] + [-5] + held[101:]
    trimmed, usable = trim_offer(params, held, edited, block_size=128)
    assert usable == 100 and trimmed["remote_num_tokens"] == 100
    assert trimmed["remote_block_ids"] == [[7]] and trimmed["remote_host"] == "h"
    # Nothing shared: an empty offer, still sent so that the decode engine frees its blocks.
    trimmed, usable = trim_offer(params, held, [-1] * 50, block_size=128)
    assert usable == 0 and trimmed["remote_block_ids"] == [[]]
    # A prompt inside the history still computes its last token.
    trimmed, usable = trim_offer(params, held, held[:130], block_size=128)
    assert usable == 129 and trimmed["remote_block_ids"] == [[7, 8]]
    assert params["remote_num_tokens"] == 299  # the stored offer is untouched


def test_unreachable_engines_give_503_with_retry_after() -> None:
    from fastapi.testclient import TestClient

    from turnkv_server.router.app import create_app
    from turnkv_server.router.config import RouterConfig

    # Nothing listens on port 9: the router must answer, not hang or crash.
    app = create_app(RouterConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                  mode="standard"))
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "2"
        assert "no engine could serve the turn" in response.json()["error"]["message"]
        assert client.get("/health").status_code in (200, 503)


# -- what the router refuses to pass on ------------------------------------------------------

@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], [1, "x"], [True, 2]])
def test_a_batch_of_prompts_is_refused(prompt: object) -> None:
    from turnkv_server.router.app import check_supported as _check_supported

    # vLLM would serve each prompt as its own request with the same kv_transfer_params: two
    # receivers of one transfer.
    with pytest.raises(BadRequest, match="batch of prompts"):
        _check_supported({"prompt": prompt})


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], ["one"], [[1, 2]], []])
def test_one_prompt_passes(prompt: object) -> None:
    from turnkv_server.router.app import check_supported as _check_supported

    _check_supported({"prompt": prompt})


def test_a_session_id_ending_in_a_slash_is_not_redirected_to_another_session() -> None:
    from fastapi.testclient import TestClient

    from turnkv_server.router.app import create_app
    from turnkv_server.router.config import RouterConfig

    app = create_app(RouterConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                  mode="standard", health_interval=60.0))
    with TestClient(app, follow_redirects=False) as client:
        for method in ("GET", "DELETE"):
            reply = client.request(method, "/v1/turnkv/sessions/abc%2F")
            # Found by no route: never a 307 to /v1/turnkv/sessions/abc, which a client
            # following redirects would then read or end.
            assert reply.status_code == 404, (method, reply.status_code)


# -- settings --------------------------------------------------------------------------------

def test_the_routers_command_line_is_built_from_its_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from turnkv_server.router.__main__ import parse_args
    from turnkv_server.router.config import RouterConfig, from_args, help_for

    monkeypatch.setenv("TURNKV_ADMIN_KEY", "root")
    monkeypatch.delenv("TURNKV_REDIS_URL", raising=False)
    args = parse_args(["--prefill", "http://p0", "--prefill", "http://p1", "--decode",
                       "http://d", "--mode", "standard", "--short-delta-tokens", "0",
                       "--redis", "redis://r/0", "--max-ttl", "60", "--default-ttl", "30"])
    assert from_args(args) == RouterConfig(
        prefill=["http://p0", "http://p1"], decode=["http://d"], mode="standard",
        short_delta_tokens=0, redis_url="redis://r/0", default_ttl=30, max_ttl=60,
        admin_key="root")  # from the environment
    # Not given: the settings' own defaults, the command line's as well.
    defaults = from_args(parse_args(["--prefill", "p", "--decode", "d", "--prefill-nixl",
                                     "a@h:1", "--decode-nixl", "b@h:2"]))
    assert defaults.mode == "turnkv" and defaults.redis_url is None
    assert defaults == RouterConfig(prefill=["p"], decode=["d"], prefill_nixl=["a@h:1"],
                                    decode_nixl=["b@h:2"], admin_key="root")
    assert help_for("redis_url").endswith("(or TURNKV_REDIS_URL)")
    with pytest.raises(ValueError, match="default_ttl <= max_ttl"):
        from_args(parse_args(["--prefill", "p", "--decode", "d", "--mode", "standard",
                              "--default-ttl", "1000"]))
