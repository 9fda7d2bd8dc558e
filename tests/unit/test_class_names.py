"""Class names, read from the source: no two classes of one name within a package.

Nothing here imports the project: each module under `sdk/turnkv` and
`server_ext/turnkv_server` is parsed with `ast`, and every class it defines counts, wherever
it is written (module level, nested in a class or a function). Two classes of one name in one
package are two things a reader must tell apart by their module (`Receive` the wire's or the
connector's?); each name should say which thing it is.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "sdk" / "turnkv", ROOT / "server_ext" / "turnkv_server")
# Duplicates whose rename waits on other work: each must still be a duplicate (remove it with
# the rename).
WAITING: frozenset[str] = frozenset()


def class_definitions(package: Path, relative_to: Path) -> dict[str, list[str]]:
    """Every class defined under `package`: name -> where (`file:line`), in file order."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{path.relative_to(relative_to)}:{node.lineno}")
    return found


def duplicates(packages: Iterable[Path], relative_to: Path) -> dict[str, list[str]]:
    """Every class name defined more than once within one package (`package.Name`), and
    where."""
    return {f"{package.name}.{name}": places
            for package in packages
            for name, places in sorted(class_definitions(package, relative_to).items())
            if len(places) > 1}


def duplicate_reports(packages: Iterable[Path], relative_to: Path,
                      waiting: frozenset[str] = frozenset()) -> list[str]:
    """One report per duplicate class name not `waiting`, and per `waiting` name that is no
    longer a duplicate."""
    found = duplicates(packages, relative_to)
    return ([f"{name}: {', '.join(places)}" for name, places in found.items()
             if name not in waiting]
            + [f"{name}: no longer defined twice; take it off WAITING"
               for name in sorted(waiting - found.keys())])


def test_the_packages_are_found() -> None:
    """Guards the check below against passing on nothing."""
    for package in PACKAGES:
        assert len(class_definitions(package, ROOT)) > 20, f"too few classes under {package}"


def test_no_two_classes_of_one_name_within_a_package() -> None:
    reports = duplicate_reports(PACKAGES, ROOT, WAITING)
    if reports:
        pytest.fail(f"{len(reports)} class name(s) defined more than once in one package; "
                    "name each for what it is:\n" + "\n".join(f"  {r}" for r in reports),
                    pytrace=False)


def test_the_check_finds_what_it_is_for(tmp_path: Path) -> None:
    files = {
        "turnkv/__init__.py": "",
        "turnkv/a.py": "class Tail:\n    pass\n",
        "turnkv/sub/__init__.py": "",
        # Nested in a function, in a subpackage: still the same package.
        "turnkv/sub/b.py": "def f():\n    class Tail:\n        pass\n",
        # The same name in another package is that package's business.
        "other/__init__.py": "class Tail:\n    pass\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    packages = [tmp_path / "turnkv", tmp_path / "other"]
    assert duplicate_reports(packages, tmp_path) == [
        "turnkv.Tail: turnkv/a.py:1, turnkv/sub/b.py:2"]
    assert duplicate_reports(packages, tmp_path, frozenset({"turnkv.Tail"})) == []
    assert duplicate_reports(packages, tmp_path, frozenset({"turnkv.Tail", "other.Tail"})) == [
        "other.Tail: no longer defined twice; take it off WAITING"]
