"""`turnkv bench`'s options, declared once (`bench.options.BenchOptions`): the command line, the
checks and the settings every mode starts from all read that one declaration."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import typer

from turnkv_server.bench.cli import _check
from turnkv_server.bench.options import WORKLOADS, BenchOptions, cli_option
from turnkv_server.bench.plan import BenchSettings, PlanError
from turnkv_server.cli import app
from turnkv_server.mode_names import BENCH_BASELINES, DEFAULT_BENCH_MODES, TURNKV_BENCH_MODES


def _bench_params() -> dict[str, Any]:
    command = typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]
    return {param.name: param for param in command.params}


def test_the_command_line_is_built_from_the_options() -> None:
    params = _bench_params()
    assert set(params) == {f.name for f in fields(BenchOptions)}
    for f in fields(BenchOptions):
        param, how = params[f.name], cli_option(f)
        assert param.default == f.default, f.name
        assert param.help == how.help, f.name
        assert param.opts == [how.flag or "--" + f.name.replace("_", "-")], f.name
    assert params["modes"].default == DEFAULT_BENCH_MODES
    # Every workload and every mode by name, the baselines before turnkv's forms.
    assert all(name in params["workload"].help for name in WORKLOADS)
    modes_help = params["modes"].help
    assert all(f"{mode} (" in modes_help for mode in (*BENCH_BASELINES, *TURNKV_BENCH_MODES))
    assert modes_help.index("baselines") < modes_help.index("turnkv-end-write")


def test_the_settings_start_from_the_options_defaults() -> None:
    options, settings = BenchOptions(), BenchSettings()
    assert (settings.model, settings.dtype, settings.turn_timeout_s, settings.stall_timeout_s) == (
        options.model, options.dtype, options.turn_timeout, options.stall_timeout)


@pytest.mark.parametrize("field_name", [f.name for f in fields(BenchOptions)
                                        if cli_option(f).minimum is not None])
def test_every_minimum_is_checked_without_the_command_line(field_name: str) -> None:
    minimum = cli_option(next(f for f in fields(BenchOptions) if f.name == field_name)).minimum
    assert minimum is not None
    flag = "--" + field_name.replace("_", "-")
    with pytest.raises(PlanError, match=flag):
        _check(BenchOptions(**{field_name: minimum - 1}))
    _check(BenchOptions(**{field_name: minimum}))
