"""notebooks/credit_assignment.ipynb: executes at the tiny size; committed as a full run."""

import json
import pathlib
import sys

import nbclient
import nbformat

from agentrl_jax import viewer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "notebooks"))
import execute  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "credit_assignment.ipynb"
# The arms of the committed full run (turn_rloo the notebook defines itself).
ARMS = ("grpo", "drgrpo", "dapo", "rloo", "turn_returns", "gae", "branching", "gigpo",
        "turn_rloo", "obs_loss")
# Those with advantages of their own in the viewer (obs_loss's are grpo's).
ESTIMATORS = tuple(a for a in ARMS if a != "obs_loss")


def _parameters_cell(nb):
  cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(cells) == 1, "one cell tagged 'parameters' holds SIZE and ROOT"
  return cells[0]


def _text(cell) -> str:
  return "".join(o.get("text", "") for o in cell.get("outputs", []))


def _images(cell) -> int:
  return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def test_committed_notebook_holds_a_full_run():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  assert 'SIZE = "full"' in _parameters_cell(nb).source
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), "committed with outputs"
  assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
  table = next(c for c in code if "summary_table" in c.source)
  for name in ARMS:
    assert name in _text(table)
  # Stored as a front end shows them: no progress bar's overwritten states.
  assert not any("\r" in o.get("text", "") for c in code for o in c.outputs)
  assert sum(_images(c) for c in code) >= 2, "the curves and the advantage heatmaps"


def test_notebook_executes_at_the_tiny_size(tmp_path):
  # Six runs build the same tiny programs: the kernel inherits the session's
  # persistent compilation cache (conftest), so each compiles once.
  nb = nbformat.read(NOTEBOOK, as_version=4)
  _parameters_cell(nb).source = f'SIZE = "tiny"\nROOT = {json.dumps(str(tmp_path))}'
  nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  table = _text(next(c for c in code if "summary_table" in c.source))
  sampled = _text(next(c for c in code if "held_out" in c.source))
  for name in ARMS:
    assert name in table and name in sampled
  assert "pass@4" in table and "estimator" in table and "masking" in table
  assert _images(next(c for c in code if "ab.plot(results)" in c.source)) == 1
  assert _images(next(c for c in code if "plot_advantages" in c.source)) == 1
  # The example episodes under every estimator, for the viewer, and its
  # page (the masking arm's advantages are grpo's).
  labels = {r["label"] for r in viewer.read_jsonl(tmp_path / "trajectories.jsonl")}
  assert labels == set(ESTIMATORS)
  assert (tmp_path / "trajectories.html").stat().st_size > 10_000


def test_coalesce_streams_keeps_what_a_front_end_shows():
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("")])
  stream = lambda name, text: nbformat.v4.new_output("stream", name=name, text=text)
  nb.cells[0].outputs = [
      stream("stdout", "start\n"), stream("stderr", "bar  0%\r"),
      stream("stderr", "bar 50%\r"), stream("stderr", "bar 100%\n"),
      stream("stderr", "a\r\nb\n"), stream("stdout", "done\n"),
      nbformat.v4.new_output("execute_result", data={"text/plain": "1"}),
      stream("stdout", "after\n")]
  execute.coalesce_streams(nb)
  assert [(o.output_type, o.get("name"), o.get("text")) for o in nb.cells[0].outputs] == [
      ("stream", "stdout", "start\n"), ("stream", "stderr", "bar 100%\na\nb\n"),
      ("stream", "stdout", "done\n"), ("execute_result", None, None),
      ("stream", "stdout", "after\n")]
