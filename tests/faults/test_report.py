"""The reliability guide's figures are the results file's, copied by the script, not by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("faults_run", ROOT / "benchmarks/faults/run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guide_shows_the_results_file() -> None:
    run = _runner()
    guide = run.DOCS.read_text()
    block = guide[guide.index(run.BEGIN) : guide.index(run.END) + len(run.END)]
    assert block == run.docs_block(run.RESULTS.read_text())
