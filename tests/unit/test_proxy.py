from __future__ import annotations

from fastapi.testclient import TestClient

from turnkv_server.proxy import PREFILL_TRANSFER_PARAMS, create_app, decode_body, prefill_body


def test_prefill_body_asks_for_one_token_and_keeps_the_prompt() -> None:
    body = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "max_completion_tokens": 50,
        "min_tokens": 5, "tools": [{"type": "function"}],
    }
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert "max_completion_tokens" not in out
    assert out["messages"] == body["messages"] and out["tools"] == body["tools"]
    assert out["kv_transfer_params"] == PREFILL_TRANSFER_PARAMS
    assert body["stream"] is True and "kv_transfer_params" not in body  # input untouched


def test_decode_body_carries_the_prefill_params() -> None:
    params = {"remote_block_ids": [1, 2], "remote_engine_id": "e"}
    out = decode_body({"model": "m", "stream": True}, params)
    assert out == {"model": "m", "stream": True, "kv_transfer_params": params}


def test_bad_requests_get_openai_style_errors_before_any_engine_is_called() -> None:
    # Unroutable engine addresses: a request that reached them would fail differently.
    client = TestClient(create_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]))
    bad_json = client.post("/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert "not valid JSON" in bad_json.json()["error"]["message"]
    not_object = client.post("/v1/completions", json=[1, 2])
    assert not_object.status_code == 400
    many = client.post("/v1/chat/completions", json={"model": "m", "n": 2, "messages": []})
    assert many.status_code == 400 and "n > 1" in many.json()["error"]["message"]
    assert client.get("/health").status_code == 200
