"""The dependency direction of the packages: entry scripts, tools/ and bench/ -> jobs/ -> train/, sample/, reward/,
models/, data/ -> core/; train/ -> sample/ and models/; sample/ -> models/; reward/, data/ and models/ stand on core/
alone; core/ imports nothing of the project. Import statements inside functions count too (a lazy import is still an
arrow); modules named in strings (``importlib.import_module``, the algorithm registry) are not seen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "data", "models", "reward", "sample", "train", "jobs", "tools", "bench")
ALLOWED = {
    "core": set(),
    "data": {"core"},
    "models": {"core"},
    "reward": {"core"},
    "sample": {"core", "models"},
    "train": {"core", "models", "sample"},
    "jobs": {"core", "data", "models", "reward", "sample", "train"},
    "tools": {"core", "data", "jobs", "models", "reward", "sample", "train"},
    "bench": {"core", "data", "jobs", "models", "reward", "sample", "train", "tools"},
}
# thin entry scripts that live beside the code they launch (`accelerate launch train/sft_sdar.py`): they call jobs/
ENTRY_SCRIPTS = {ROOT / "train" / f"sft_{family}.py"
                 for family in ("trado", "sdar", "dream", "llada", "mmada", "llada2")}


def imported_packages(path: Path) -> dict[str, int]:
    """The project packages ``path`` imports (absolute imports, at any depth), each with the line of its first
    import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in PACKAGES:
                found.setdefault(top, node.lineno)
    return found


def arrows_against_the_direction(package: str) -> list[str]:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path in ENTRY_SCRIPTS:
            continue
        for target, line in imported_packages(path).items():
            if target != package and target not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return wrong


def test_the_allowed_arrows_have_no_circle():
    """ALLOWED itself is a DAG (so the packages following it cannot import in a circle)."""
    order: list[str] = []
    pending = dict(ALLOWED)
    while pending:
        ready = [p for p, deps in pending.items() if deps <= set(order)]
        assert ready, f"a circle among {sorted(pending)}"
        order.extend(sorted(ready))
        for p in ready:
            del pending[p]
    assert order[0] == "core"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_against_the_dependency_direction(package):
    assert arrows_against_the_direction(package) == []


def test_the_entry_scripts_exist():
    assert all(path.is_file() for path in ENTRY_SCRIPTS)


def test_the_check_sees_imports_inside_functions(tmp_path):
    """The check would catch a lazy import (the kind that once put a jobs/ import in core/entry.py)."""
    module = tmp_path / "entry.py"
    module.write_text("def check(cfg):\n    from jobs.config import is_demo_model_dir\n    import models.errors\n")
    assert imported_packages(module) == {"jobs": 2, "models": 3}
