"""The notebooks under notebooks/: committed without outputs (git holds their source; running them makes
the outputs), importing the installed packages and nothing from the tests, and each runs top to bottom on
a CPU, in a fresh python3 kernel, within its time budget."""

from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ("batch_eval.ipynb", "quickstart.ipynb", "train_to_serve.ipynb")
# Each takes under two minutes on a 2-core CPU, kernel start, model load and compiling included (train_to_serve and
# batch_eval under one, quickstart under two with nothing in the compiled-step store): the budget catches a notebook
# that grew heavy, not noise.
BUDGET_SECONDS = 300
TEST_IMPORT = re.compile(r"^\s*(from|import)\s+(tests|conftest)\b", re.MULTILINE)


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS_DIR / name, as_version=4)


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs_and_without_test_imports(name):
    notebook = read(name)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    with_outputs = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count is not None]
    assert not with_outputs, f"{name}: code cells {with_outputs} hold outputs; clear them before committing"
    assert not any(TEST_IMPORT.search(cell.source) for cell in code), f"{name} imports test helpers"
    assert notebook.metadata.kernelspec.name == "python3"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_runs_top_to_bottom_within_its_budget(name):
    notebook = read(name)
    client = NotebookClient(
        notebook, timeout=BUDGET_SECONDS, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, when a cell fails
    seconds = time.perf_counter() - start
    assert seconds < BUDGET_SECONDS, f"{name} ran {seconds:.0f} s, over its budget of {BUDGET_SECONDS} s"
