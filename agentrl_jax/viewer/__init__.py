"""See what was trained on: episode records (JSONL) and a static HTML viewer.

  records = viewer.read_jsonl("runs/default/trajectories.jsonl")
  pathlib.Path("view.html").write_text(viewer.render(records))

`experiments/view.py --workdir runs/default` does the same from a shell.
"""

from agentrl_jax.viewer.page import render
from agentrl_jax.viewer.records import (episode_record, pieces, read_jsonl, sample_groups,
                                        write_jsonl)

__all__ = ["episode_record", "pieces", "read_jsonl", "render", "sample_groups", "write_jsonl"]
