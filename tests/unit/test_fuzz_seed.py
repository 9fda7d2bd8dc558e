"""The suite's fuzz is a fuzz (tests/support/fuzz_seed.py): each run of the router's fuzz tests
draws new cases, the run's seed replays them, and a failing fuzz test says how.

The router's fuzz tests (tests/integration/test_router_security.py) are run here without a
cluster, on a client that records what they send (test_router_fuzz.Recorder): what they send
is what they drew. A test file of its own shows a failure's message, and its replay, through
pytest.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import fuzz_seed
from tests.support.router_fuzz import KINDS
from tests.unit.test_router_fuzz import ROUTER, TESTS, Recorder

REPO = Path(__file__).resolve().parents[2]


def drawn() -> dict[str, list[str]]:
    """What each of the router's fuzz tests sends, run on a recording client."""
    cluster = SimpleNamespace(router=ROUTER, served_model_name="tiny")
    sent = {}
    for kind, test in TESTS.items():
        client = Recorder()
        test(cluster=cluster, client=client)
        sent[kind] = [repr(request) for request in client.sent]
    return sent


def test_each_run_draws_new_cases_and_its_seed_replays_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fuzz_seed, "SEED", 1234)
    here = drawn()
    assert drawn() == here
    monkeypatch.setattr(fuzz_seed, "SEED", 1235)
    other = drawn()
    for kind, test in TESTS.items():
        assert other[kind] != here[kind], f"{kind}: another seed drew the same cases"
        # The frozen cases (the test's `@example`s) come first, whatever the seed.
        frozen = sum(len(KINDS[kind].build("tiny", **copy.deepcopy(case.kwargs)))
                     for case in getattr(test, "hypothesis_explicit_examples", ()))
        assert frozen > 0 and other[kind][:frozen] == here[kind][:frozen], kind


def test_a_run_takes_its_seed_from_the_environment() -> None:
    assert fuzz_seed.run_seed({fuzz_seed.ENV: " 42 "}) == 42
    fresh = {fuzz_seed.run_seed({}) for _ in range(4)}
    assert len(fresh) > 1
    with pytest.raises(ValueError, match=fuzz_seed.ENV):
        fuzz_seed.run_seed({fuzz_seed.ENV: "forty-two"})


# Not shrunk: the failing case is the first one the seed draws, which another seed would not.
FAILING = '''
from hypothesis import Phase, given, strategies as st
from tests.support.fuzz_seed import fuzz

@fuzz(200, phases=[Phase.generate])
@given(st.integers(0, 10**9))
def test_never_three_modulo_seven(n):
    assert n % 7 != 3, n
'''


def run_pytest(test_file: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(test_file.parent), str(test_file)],
        cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def falsifying(output: str) -> str:
    found = re.search(r"(?:Falsifying example|Failing test case): (.*?\))", output, re.S)
    assert found, output[-3000:]
    return found.group(1)


def test_a_failing_fuzz_says_how_to_replay_it_and_the_replay_fails_alike(
        tmp_path: Path) -> None:
    test_file = tmp_path / "test_fuzzed.py"
    test_file.write_text(textwrap.dedent(FAILING))
    env: dict[str, Any] = {**os.environ,
                           "PYTHONPATH": os.pathsep.join([str(REPO),
                                                          os.environ.get("PYTHONPATH", "")])}
    env.pop(fuzz_seed.ENV, None)
    first = run_pytest(test_file, env)
    said = re.search(rf"replay this fuzz's cases: {fuzz_seed.ENV}=(\d+) pytest "
                     rf"'(\S+)'", first)
    assert said, first[-3000:]
    assert said.group(2).endswith("test_fuzzed.py::test_never_three_modulo_seven")
    again = run_pytest(test_file, {**env, fuzz_seed.ENV: said.group(1)})
    assert falsifying(again) == falsifying(first)
    assert f"{fuzz_seed.ENV}={said.group(1)}" in again
