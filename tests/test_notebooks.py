"""The notebooks: each jupytext `.py` has its paired `.ipynb` with the same cells and no outputs,
and each one runs top to bottom on a fresh kernel (tiny model, CPU, one device)."""

import glob
import os

import jupytext
import nbclient
import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.py")))


def cells(notebook) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def test_there_are_notebooks():
    names = [os.path.basename(p) for p in NOTEBOOKS]
    assert names == [
        "01_run_generate_routing.py",
        "02_compare_sweep.py",
        "03_rl_objective_playground.py",
    ]


@pytest.mark.parametrize("script", NOTEBOOKS, ids=os.path.basename)
def test_pair_is_in_sync_and_stripped(script):
    paired = script[: -len(".py")] + ".ipynb"
    assert os.path.isfile(paired), f"{paired} missing: jupytext --sync {script}"
    stored = nbformat.read(paired, as_version=4)
    assert cells(stored) == cells(jupytext.read(script)), f"out of sync: jupytext --sync {script}"
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{paired}: has outputs"


@pytest.mark.parametrize("script", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(script, tmp_path):
    notebook = jupytext.read(script)
    env = dict(
        os.environ,
        XLA_FLAGS="",  # one CPU device, as a user's notebook has
        JAX_PLATFORMS="cpu",
        MPLBACKEND="Agg",
        TMPDIR=str(tmp_path),  # what a notebook leaves behind is the test's to remove
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    )
    client = nbclient.NotebookClient(
        notebook,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(script)}},
    )
    client.execute(env=env)  # raises CellExecutionError naming the failing cell
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
