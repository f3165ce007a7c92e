"""Renders a run's recorded episodes as one static HTML page.

  python experiments/view.py --workdir runs/default            # -> runs/default/trajectories.html
  python experiments/view.py --workdir runs/credit_ablation    # each scheme's advantages
  python experiments/view.py --workdir runs/default --phase train --screenshot shot.png

Reads `<workdir>/trajectories.jsonl` (written by train_agent.py every
`log.trajectories_every` iterations and at each evaluation, or by
credit_ablation.py: the same episodes under each scheme) and writes the page
next to it (`--out` elsewhere). The page needs no server and no network.
`--screenshot` also opens it in headless Chromium and saves a PNG.
"""

import argparse
import pathlib
import shutil
import subprocess
import tempfile

from agentrl_jax import viewer


def write_page(workdir, out=None, title=None, phase=None) -> pathlib.Path:
  """Renders `<workdir>/trajectories.jsonl` (only `phase`'s episodes, if
  given) to `out` (default: next to it)."""
  workdir = pathlib.Path(workdir)
  records = [r for r in viewer.read_jsonl(workdir / "trajectories.jsonl")
             if phase is None or r["phase"] == phase]
  out = pathlib.Path(out) if out else workdir / "trajectories.html"
  out.write_text(viewer.render(records, title or f"Episodes of {workdir.name}"))
  return out


def chromium() -> str:
  """The headless browser's executable (Debian's `chromium` package)."""
  for name in ("chromium", "chromium-browser", "google-chrome"):
    path = shutil.which(name)
    if path:
      return path
  raise FileNotFoundError("no Chromium found: apt-get install chromium")


def browse(page, *, screenshot=None, width: int = 1280, height: int = 1600,
           timeout: float = 120.0) -> subprocess.CompletedProcess:
  """Opens `page` in headless Chromium; returns the run, whose stdout is the
  DOM after the page's script ran and whose stderr holds the console log.
  With `screenshot`, also saves a PNG of the first `height` pixels."""
  page = pathlib.Path(page).resolve()
  with tempfile.TemporaryDirectory() as profile:
    args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
            "--no-first-run", f"--user-data-dir={profile}", "--enable-logging=stderr",
            "--v=0", f"--window-size={width},{height}", "--virtual-time-budget=5000"]
    if screenshot is not None:
      subprocess.run(args + [f"--screenshot={pathlib.Path(screenshot).resolve()}",
                             page.as_uri()],
                     capture_output=True, text=True, timeout=timeout, check=True)
    return subprocess.run(args + ["--dump-dom", page.as_uri()], capture_output=True,
                          text=True, timeout=timeout, check=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", default=None)
  p.add_argument("--phase", default=None, help="only these episodes: train, eval, example")
  p.add_argument("--screenshot", default=None)
  args = p.parse_args()
  out = write_page(args.workdir, args.out, phase=args.phase)
  print(f"wrote {out}")
  if args.screenshot:
    browse(out, screenshot=args.screenshot)
    print(f"screenshot: {args.screenshot}")


if __name__ == "__main__":
  main()
