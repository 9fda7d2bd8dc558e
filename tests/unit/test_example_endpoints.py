"""The examples' shared command line (examples/_endpoint.py): every example takes the same
endpoint options and finds the cluster `turnkv up` started, with the API's path its client
expects (the Anthropic client adds /v1 itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import turnkv_server.launcher
from examples._endpoint import endpoint, endpoint_parser

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Those run as `python examples/NAME.py` with the shared options (the coding agent, the
# copilot backend and the chat demo have command lines of their own).
SHARED = ("agents_sdk", "anthropic_messages", "langchain_responses", "langchain_agent",
          "llamaindex_chat")


@pytest.mark.parametrize("name", SHARED)
def test_each_example_runs_as_a_script_with_the_shared_options(name: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=120, cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stderr
    for option in ("--base-url", "--model", "--api-key", "--max-tokens"):
        assert option in done.stdout, (name, option)


def test_ttl_and_the_reply_length_are_each_examples_own() -> None:
    tagged = endpoint_parser(None).parse_args([])
    assert (tagged.ttl, tagged.max_tokens) == (120.0, 96)
    untagged = endpoint_parser(None, max_tokens=None, ttl=False).parse_args([])
    assert untagged.max_tokens is None and not hasattr(untagged, "ttl")


def test_a_given_endpoint_and_model_are_used_as_given() -> None:
    args = SimpleNamespace(base_url="http://127.0.0.1:9/v1", model="m", api_key="k")
    assert endpoint(args) == ("http://127.0.0.1:9/v1", "m")
    assert endpoint(SimpleNamespace(base_url="http://127.0.0.1:9", model="m", api_key="k"),
                    path="") == ("http://127.0.0.1:9", "m")


def test_the_running_cluster_is_found_with_the_apis_path(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    state = SimpleNamespace(router="http://127.0.0.1:8000", served_model_name="served")
    monkeypatch.setattr(turnkv_server.launcher, "current_state", lambda: state)
    args = SimpleNamespace(base_url=None, model=None, api_key="k")
    assert endpoint(args) == ("http://127.0.0.1:8000/v1", "served")
    assert endpoint(args, path="") == ("http://127.0.0.1:8000", "served")
    args.model = "other"
    assert endpoint(args)[1] == "other"


def test_without_a_cluster_or_an_endpoint_it_says_how_to_start_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turnkv_server.launcher, "current_state", lambda: None)
    with pytest.raises(SystemExit, match="turnkv up"):
        endpoint(SimpleNamespace(base_url=None, model=None, api_key="k"))
