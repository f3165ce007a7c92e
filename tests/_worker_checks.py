"""The check registry and runner shared by the subprocess test workers."""

import sys
import traceback

CHECKS = []


def check(fn):
  """Registers a check: a function that raises on failure."""
  CHECKS.append(fn)
  return fn


def run_checks():
  """Runs every check, printing `PASS name` or `FAIL name` and a traceback;
  exits with the number of failures."""
  failures = 0
  for fn in CHECKS:
    try:
      fn()
      print(f"PASS {fn.__name__}", flush=True)
    except Exception:  # pylint: disable=broad-except
      failures += 1
      print(f"FAIL {fn.__name__}\n{traceback.format_exc()}", flush=True)
  sys.exit(failures)
