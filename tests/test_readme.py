"""CI must prove the README: .ci/run runs the README's test command verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  block = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```", readme, re.S)
  assert block, "README lost its marked test command block"
  command = block.group(1).strip()
  ci_lines = [l.strip() for l in (ROOT / ".ci/run").read_text().splitlines()]
  assert command in ci_lines
