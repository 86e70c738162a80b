"""The package stays in rooms one person can hold: no module over 1,000 lines, no class over
700 (split by responsibility before adding to one that is close)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "oncely"
MAX_MODULE_LINES = 1000
MAX_CLASS_LINES = 700


def test_no_module_is_too_long() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_class_is_too_long() -> None:
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert long == {}
