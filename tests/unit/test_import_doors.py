"""The layers that must not reach up: storage and network never import
Sandbox, the plan never imports network.py, the store never imports the
registry client (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nsbox

PACKAGE = Path(nsbox.__file__).parent  # the checkout's, or the staged install's (tests/run.sh)


def imports(path: Path) -> set[str]:
    """Every nsbox module `path` imports, at any depth of its code."""
    package = ".".join(("nsbox", *path.relative_to(PACKAGE).parent.parts))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" for a in node.names)
            found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("nsbox")}


@pytest.mark.parametrize("modules, forbidden", [
    ("storage/*.py", "nsbox.sandbox"),
    ("network.py", "nsbox.sandbox"),
    ("plan/*.py", "nsbox.network"),
    ("storage/store.py", "nsbox.storage.registry"),
])
def test_no_import_reaches_up(modules: str, forbidden: str) -> None:
    paths = sorted(PACKAGE.glob(modules))
    assert paths
    bad = {p.name: sorted(m for m in imports(p) if m == forbidden or m.startswith(forbidden + "."))
           for p in paths}
    assert {name: ms for name, ms in bad.items() if ms} == {}
