"""Executes a notebook in place, as committed: `python notebooks/execute.py NOTEBOOK`
(`--coalesce-only`: only tidy the outputs of one executed otherwise).

It runs every cell in the notebook's own folder (its relative paths hold)
with no timeout, then coalesces each cell's stream outputs the way a
notebook front end shows them: consecutive writes to one stream merged, a
progress bar's carriage-return updates reduced to their last state. (Each
tqdm update is an output of its own; a full run has tens of thousands.)
"""

import pathlib
import re
import sys

import nbclient
import nbformat

_OVERWRITTEN = re.compile(r"[^\n]*\r(?=[^\n])")  # a line's text before its last \r


def coalesce_streams(nb) -> None:
  """Merges each code cell's consecutive stream outputs of one name and
  drops what a carriage return overwrote."""
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    merged = []
    for out in cell.outputs:
      if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
          and merged[-1].name == out.name):
        merged[-1].text += out.text
      else:
        merged.append(out)
    for out in merged:
      if out.output_type == "stream":
        out.text = _OVERWRITTEN.sub("", out.text.replace("\r\n", "\n"))
    cell.outputs = merged


def main(path: str, *flags: str) -> None:
  if set(flags) - {"--coalesce-only"}:
    raise SystemExit(f"unknown flags {flags}; usage: execute.py NOTEBOOK [--coalesce-only]")
  path = pathlib.Path(path).resolve()
  nb = nbformat.read(path, as_version=4)
  if "--coalesce-only" not in flags:
    nbclient.NotebookClient(nb, timeout=None, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
  coalesce_streams(nb)
  nbformat.write(nb, path)


if __name__ == "__main__":
  main(*sys.argv[1:])
