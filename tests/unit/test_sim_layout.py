"""The simulator's place in the import graph: it imports turnkv's policies, and nothing of the
product imports it (only the command line, for `turnkv sim`'s options, whose module imports no
other part of the simulator)."""

from __future__ import annotations

from tests.unit.test_layout import _in, project

SIM = "turnkv_server.sim"
COMMAND = "turnkv_server.sim.command"


def test_nothing_but_the_command_line_imports_the_simulator() -> None:
    known, _ = project()
    assert any(_in(name, SIM) for name in known), "the simulator's modules are not found"
    found = [f"{module.where}:{imp.line}: {module.name} imports {imp.target}"
             for module in known.values() if not _in(module.name, SIM)
             for imp in module.imports
             if _in(imp.target, SIM) and (module.name, imp.target) != (
                 "turnkv_server.cli", COMMAND)]
    assert not found, "the product imports the simulator:\n" + "\n".join(found)


def test_the_command_module_loads_nothing_of_the_simulator_at_import() -> None:
    known, _ = project()
    command = known[COMMAND]
    assert {imp.target for imp in command.imports if _in(imp.target, SIM)} == {
        "turnkv_server.sim.runner"}  # inside the command's function, when it runs


def test_the_simulator_imports_the_policies_it_runs() -> None:
    known, _ = project()
    imported = {imp.target for name, module in known.items() if _in(name, SIM)
                for imp in module.imports}
    for policy in ("turnkv_server.router.planner", "turnkv_server.router.weighing",
                   "turnkv_server.connector.leases", "turnkv_server.router.admission"):
        assert policy in imported, f"the simulator does not import {policy}"
