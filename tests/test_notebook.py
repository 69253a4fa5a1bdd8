"""notebooks/tour.ipynb runs top to bottom on CPU and shows what it says it shows; it is kept without outputs
and in step with its jupytext twin, tour.py."""

import re
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_kept_without_outputs_and_paired():
    nb = nbformat.read(NOTEBOOKS / "tour.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    twin = jupytext.read(NOTEBOOKS / "tour.py")
    assert [(c.cell_type, c.source) for c in nb.cells] == [(c.cell_type, c.source) for c in twin.cells]
    first_tokens = next(i for i, c in enumerate(nb.cells) if "generate(" in c.source)
    assert first_tokens < 10


@pytest.fixture(scope="module")
def executed(subprocess_env, monkeypatch_module):
    for key, value in subprocess_env.items():
        monkeypatch_module.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / "tour.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def outputs(nb, mime: str) -> list[str]:
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and mime == "text/plain":
                found.append(out.text)
            elif mime in out.get("data", {}):
                found.append(out.data[mime])
    return found


def test_runs_top_to_bottom_and_shows_its_figures(executed):
    text = "\n".join(outputs(executed, "text/plain"))
    assert "CpuDevice(id=7)" in text                                   # eight fake devices
    assert outputs(executed, "image/png")                              # the logits plot
    difference = float(re.search(r"largest difference ([0-9.e+-]+)", text).group(1))
    assert difference < 1e-4                                           # against transformers' logits
    tables = "\n".join(outputs(executed, "text/markdown"))
    assert re.search(r"\| decode \| all-reduce \| [1-9]\d* \|", tables)  # the collective report of tp=2
    assert re.search(r"run it: python -m jaxinfer.serve --mesh \S+=2", text)  # the planner's winner
    assert re.search(r"\[\d+(, \d+){11}\]", text)                      # the variant's 12 tokens on tp=2
