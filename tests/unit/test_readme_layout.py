"""The README's Layout section names every module and C file of the tree,
and the README stays a guide: at most 16 KB, every relative link resolving."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

pytestmark = pytest.mark.skipif(not (REPO / "nsbox").is_dir() or not README.is_file(),
                                reason="needs the checkout's README.md and nsbox/ (not an installed copy)")


def layout_block() -> str:
    section = README.read_text().split("\n## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_every_module_is_named_in_its_folder_line() -> None:
    block = layout_block()
    # The entries of each folder: its line and the indented lines under it.
    entries: dict[str, str] = {}
    current = "nsbox"
    for line in block.splitlines():
        m = re.match(r"\s*(csrc/\w+/|tests/\w+/|[a-z]+/)\s", line)
        if m:
            current = m.group(1).rstrip("/")
        elif not line.startswith(" " * 11):
            current = "nsbox"
        entries[current] = entries.get(current, "") + " " + line
    missing = []
    for path in sorted((REPO / "nsbox").rglob("*.py")):
        rel = path.relative_to(REPO / "nsbox")
        if path.name == "__init__.py" and rel.parent != Path("."):
            continue
        folder = rel.parts[0] if len(rel.parts) > 1 else "nsbox"
        if not re.search(rf"(?<![\w.]){re.escape(path.stem)}\b", entries.get(folder, "")):
            missing.append(str(rel))
    for path in sorted((REPO / "csrc").rglob("*.[ch]")):
        rel = path.relative_to(REPO)
        folder = f"csrc/{rel.parts[1]}"
        if path.name not in entries.get(folder, "") and f"{path.stem}.c/.h" not in entries.get(folder, ""):
            missing.append(str(rel))
    assert not missing, f"README's Layout section does not name: {missing}"


def test_readme_is_a_guide_with_working_links() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 16 * 1024
    broken = []
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
