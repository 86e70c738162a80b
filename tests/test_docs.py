"""Every Python example in the README and the guides runs as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
SKIP_MARK = "<!-- not run -->"


def _examples() -> list[object]:
    examples = []
    for document in DOCUMENTS:
        text = document.read_text()
        for number, match in enumerate(BLOCK.finditer(text), start=1):
            preceding = text[: match.start()].rstrip().splitlines()[-1:]
            if preceding == [SKIP_MARK]:
                continue
            name = f"{document.relative_to(ROOT)}#{number}"
            examples.append(pytest.param(match.group(1), id=name))
    return examples


@pytest.mark.parametrize("code", _examples())
def test_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example runs as a fresh module, in a fresh working directory, without raising."""
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("__docs__")  # a real module, as a reader's code would be
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    exec(compile(code, "<docs>", "exec"), namespace)
    for value in namespace.values():
        close = getattr(value, "close", None)
        if callable(close) and type(value).__name__.endswith("Store"):
            close()


def test_api_reference_is_current() -> None:
    """docs/reference.md matches the docstrings (regenerate: python scripts/gen_reference.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts/gen_reference.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs/reference.md").read_text() == module.render()


def test_benchmark_figures_are_current() -> None:
    """The docs' figures are the results files' (regenerate: python scripts/gen_figures.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_figures", ROOT / "scripts/gen_figures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for page in module.PAGES:
        assert module.render(page.read_text()) == page.read_text(), page
