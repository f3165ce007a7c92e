"""Python tool: small programming tasks, checked by hidden tests in a sandbox.

Each task asks for a function `solve(...)` (ten templated kinds: digit sums,
word reversal, letter counts, recurrences, prime counts, gcd, run-length
encoding, palindromes, sums of multiples, Caesar shifts; each with its own
parameters). Protocol, also stated in `system_prompt`:

    <python>code</python>   runs code in the sandbox; the observation is its
                            stdout/stderr (cut to a budget) or the error or
                            time limit that stopped it. The episode goes on.
    <submit>code</submit>   runs the hidden tests on the `solve` that code
                            defines; the episode ends with outcome 1.0 if all
                            pass, else 0 (+ `partial_credit` * fraction passed
                            as the process part).

The hidden inputs go to the sandbox, the expected outputs never do: the
sandbox reports what `solve` returned and the comparison happens here, so
code that reads the harness or fakes its output cannot pass without
computing the right answers.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
from typing import Any, Callable

from agentrl_jax.envs.base import Expert, Task, TextEnvironment, hashed_draws, tool_call
from agentrl_jax.envs.sandbox import Sandbox, SandboxResult

SPLITS = ("train", "test")
NUM_CASES = 8
_USAGE = ("<python>code</python>", "<submit>code</submit>")
_FENCE = re.compile(r"^```[\w-]*\n(.*?)\n?```$", re.DOTALL)
_RESULTS = "__RESULTS__ "
_MAX_RESULT_CHARS = 300  # per case, so every result fits the output budget

# Runs in the sandbox: stdin carries {"code", "cases"}; prints one line with
# each case's ["ok", json of the return value] or ["error", message]. The
# submission's own prints are swallowed so they cannot crowd the line out.
_HARNESS = f"""
import contextlib, io, json, sys, traceback
payload = json.load(sys.stdin)
results, namespace = [], {{"__name__": "__submission__"}}
with contextlib.redirect_stdout(io.StringIO()):
  try:
    exec(compile(payload["code"], "<submission>", "exec"), namespace)
  except BaseException:
    traceback.print_exc(limit=-2)
  solve = namespace.get("solve")
  if not callable(solve):
    print("The submission does not define a function solve.", file=sys.stderr)
  for args in payload["cases"] if callable(solve) else []:
    try:
      out = json.dumps(solve(*args), sort_keys=True)
      results.append(["ok", out] if len(out) <= {_MAX_RESULT_CHARS} else
                     ["error", "the return value is too large"])
    except BaseException as e:
      results.append(["error", f"{{type(e).__name__}}: {{e}}"[:200]])
print({_RESULTS!r} + json.dumps(results))
"""

# A kind: rng -> (prompt, reference solution, rng -> hidden argument lists).
_Kind = Callable[[random.Random], tuple[str, str, Callable[[random.Random], list[list]]]]


def _words(r: random.Random, lo: int, hi: int) -> str:
  return " ".join("".join(r.choices(string.ascii_lowercase, k=r.randint(1, 7)))
                  for _ in range(r.randint(lo, hi)))


def _digit_sum(r):
  base, power = r.randint(2, 16), r.choice((1, 2))
  what = "digits" if power == 1 else "squares of the digits"
  return (f"Write a Python function `solve(n)` that returns the sum of the {what} "
          f"of the non-negative integer n written in base {base}.",
          f"def solve(n):\n  total = 0\n  while n:\n    n, digit = divmod(n, {base})\n"
          f"    total += digit ** {power}\n  return total\n",
          lambda c: [[0]] + [[c.randint(1, 10 ** c.randint(1, 9))] for _ in range(NUM_CASES - 1)])


def _reverse_words(r):
  sep, flip = r.choice((" ", "-", "_", ", ", " | ", "/")), r.random() < 0.5
  return (f"Write a Python function `solve(s)` that takes a string of words separated "
          f"by single spaces and returns the words in reverse order"
          f"{', each word also reversed,' if flip else ''} joined by {sep!r}.",
          f"def solve(s):\n  return {sep!r}.join(w{'[::-1]' if flip else ''} "
          f"for w in reversed(s.split(' ')))\n",
          lambda c: [[_words(c, 1, 6)] for _ in range(NUM_CASES)])


def _count_letters(r):
  letters = "".join(sorted(r.sample(string.ascii_lowercase, r.randint(3, 6))))
  return (f"Write a Python function `solve(s)` that returns how many characters of the "
          f"string s are one of the lowercase letters {letters!r}.",
          f"def solve(s):\n  return sum(c in {letters!r} for c in s)\n",
          lambda c: [["".join(c.choices(string.ascii_letters + "  ", k=c.randint(0, 30)))]
                     for _ in range(NUM_CASES)])


def _recurrence(r):
  a, b, m = r.randint(0, 9), r.randint(1, 9), r.choice((97, 101, 1000, 10007, 65536))
  return (f"Let a(0) = {a}, a(1) = {b} and a(n) = a(n-1) + a(n-2) for n >= 2. Write a "
          f"Python function `solve(n)` that returns a(n) modulo {m}.",
          f"def solve(n):\n  x, y = {a}, {b}\n  for _ in range(n):\n    x, y = y, x + y\n"
          f"  return x % {m}\n",
          lambda c: [[0], [1]] + [[c.randint(2, 300)] for _ in range(NUM_CASES - 2)])


def _count_primes(r):
  k = r.randint(2, 10)
  rem = r.randrange(k)
  return (f"Write a Python function `solve(n)` that returns how many prime numbers p "
          f"<= n satisfy p % {k} == {rem}.",
          f"def solve(n):\n  return sum(1 for p in range(2, n + 1) if p % {k} == {rem} and "
          f"all(p % d for d in range(2, int(p ** 0.5) + 1)))\n",
          lambda c: [[1]] + [[c.randint(2, 3000)] for _ in range(NUM_CASES - 1)])


def _gcd_list(r):
  t = r.randint(0, 30)

  def cases(c):
    out = []
    for _ in range(NUM_CASES):
      g = c.randint(1, 12)
      # Multiples of g, and numbers <= t that must be left out.
      xs = [g * c.randint(1, 12) for _ in range(c.randint(0, 6))] + [c.randint(0, t)]
      c.shuffle(xs)
      out.append([xs])
    return out

  return (f"Write a Python function `solve(xs)` that returns the greatest common divisor "
          f"of the numbers in the list xs that are greater than {t}, or 0 if there are none.",
          f"import math\n\ndef solve(xs):\n  return math.gcd(*[x for x in xs if x > {t}])\n",
          cases)


def _run_length(r):
  k, alphabet = r.randint(1, 4), r.choice(("ab", "abc", "xyz", "01"))
  return (f"Write a Python function `solve(s)` that returns the run-length encoding of "
          f"the string s as a list of [character, count] pairs, in order, keeping only "
          f"runs of at least {k} characters.",
          f"import itertools\n\ndef solve(s):\n  runs = [[ch, len(list(g))] for ch, g in "
          f"itertools.groupby(s)]\n  return [run for run in runs if run[1] >= {k}]\n",
          lambda c: [["".join(ch * c.randint(1, 5) for ch in c.choices(alphabet, k=c.randint(0, 6)))]
                     for _ in range(NUM_CASES)])


def _palindrome(r):
  ignore = "".join(r.sample(" ,.!?-", r.randint(1, 6)))

  def cases(c):
    out = []
    for i in range(NUM_CASES):
      half = c.choices("abcAB", k=c.randint(0, 5))
      chars = half + half[::-1] if i % 2 else half + c.choices("abc", k=2) + half
      for _ in range(c.randint(0, 3)):
        chars.insert(c.randint(0, len(chars)), c.choice(" ,.!?-"))
      out.append(["".join(chars)])
    return out

  return (f"Write a Python function `solve(s)` that returns True if the string s reads "
          f"the same backwards once upper/lower case is ignored and the characters "
          f"{ignore!r} are removed, else False.",
          f"def solve(s):\n  t = [c.lower() for c in s if c not in {ignore!r}]\n"
          f"  return t == t[::-1]\n",
          cases)


def _sum_multiples(r):
  a, b = sorted(r.sample(range(2, 21), 2))
  return (f"Write a Python function `solve(n)` that returns the sum of all integers x "
          f"with 1 <= x <= n that are divisible by {a} or by {b}.",
          f"def solve(n):\n  return sum(x for x in range(1, n + 1) if x % {a} == 0 or "
          f"x % {b} == 0)\n",
          lambda c: [[0]] + [[c.randint(1, 5000)] for _ in range(NUM_CASES - 1)])


def _caesar(r):
  k, forward = r.randint(1, 25), r.random() < 0.5
  return (f"Write a Python function `solve(s)` that returns s with every lowercase letter "
          f"shifted {k} places {'forward' if forward else 'backward'} in the alphabet "
          f"(wrapping around between z and a); other characters stay as they are.",
          f"def solve(s):\n  return ''.join(chr((ord(c) - 97 {'+' if forward else '-'} {k}) % 26 "
          f"+ 97) if 'a' <= c <= 'z' else c for c in s)\n",
          lambda c: [["".join(c.choices(string.ascii_lowercase * 3 + "AZ09 .", k=c.randint(0, 25)))]
                     for _ in range(NUM_CASES)])


# name -> (kind, level): level 1 kinds need a loop or a small algorithm.
_KINDS: dict[str, tuple[_Kind, int]] = {
    "digit_sum": (_digit_sum, 0), "reverse_words": (_reverse_words, 0),
    "count_letters": (_count_letters, 0), "recurrence": (_recurrence, 1),
    "count_primes": (_count_primes, 1), "gcd_list": (_gcd_list, 0),
    "run_length": (_run_length, 1), "palindrome": (_palindrome, 0),
    "sum_multiples": (_sum_multiples, 0), "caesar": (_caesar, 1)}


def _make_task(name: str, prompt: str, solution: str, cases_fn, digest: str, level: int) -> Task:
  # Hidden inputs depend on the task alone; expected outputs come from the
  # reference solution, which is our own code and runs here.
  cases = cases_fn(random.Random(digest))
  namespace: dict[str, Any] = {}
  exec(solution, namespace)  # pylint: disable=exec-used
  tests = tuple((json.dumps(args), json.dumps(namespace["solve"](*args), sort_keys=True))
                for args in cases)
  return Task(f"python/{name}/{digest[:12]}", prompt,
              {"kind": name, "solution": solution, "tests": tests}, level)


@dataclasses.dataclass
class _Expert:
  """Tries its solution on the first hidden input, then submits it."""

  task: Task
  turn: int = 0

  def __call__(self, observation: str) -> str:
    self.turn += 1
    solution = self.task.data["solution"]
    if self.turn == 1:
      args = self.task.data["tests"][0][0]
      return f"<python>\n{solution}\nprint(solve(*{args}))\n</python>"
    return f"<submit>\n{solution}</submit>"


class PythonToolEnv(TextEnvironment):
  """Programming tasks: `<python>` runs code, `<submit>` runs hidden tests.

  Args:
    sandbox: the limits for every run (default `Sandbox()`); runs share no
      state, so one Sandbox may serve many environments.
    partial_credit: weight of the fraction of hidden tests passed, paid as
      the `process` part on submission (0: outcome only).
  """

  system_prompt = (
      "Solve the programming task in Python 3 (standard library only). To run "
      "code and see its output, write <python>code</python>; nothing is kept "
      "between runs. When your function `solve` is ready, write "
      "<submit>code</submit> with the complete code that defines it: hidden "
      "tests call solve and the episode ends. You may reason first inside "
      "<think>...</think>.")
  stop_strings = ("</python>", "</submit>")

  def __init__(self, *, sandbox: Sandbox | None = None, partial_credit: float = 0.0,
               format_penalty: float = 0.0, step_cost: float = 0.0):
    super().__init__(format_penalty=format_penalty, step_cost=step_cost)
    self.sandbox = sandbox if sandbox is not None else Sandbox()
    self.partial_credit = partial_credit
    # The rollout's per-call deadline: a step runs the sandbox once, which
    # enforces its own limits; this only catches a sandbox that fails to.
    self.deadline_s = self.sandbox.max_seconds + 10.0

  @classmethod
  def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
    """`n` distinct tasks of `split` (a hash partition of the task text:
    about 1 in 5 is a test task), kinds drawn uniformly."""
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; known: {SPLITS}")

    def draw(rng: random.Random):
      name = rng.choice(sorted(_KINDS))
      kind, level = _KINDS[name]
      prompt, solution, cases_fn = kind(rng)
      return prompt, (name, solution, cases_fn, level)

    return [_make_task(name, prompt, solution, cases_fn, digest, level)
            for prompt, digest, (name, solution, cases_fn, level)
            in hashed_draws(split, n, seed, draw)]

  @classmethod
  def expert(cls, task: Task) -> Expert:
    return _Expert(task)

  def _reset(self, task: Task) -> str:
    return f"Task: {task.prompt}"

  def _step(self, action: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    call = tool_call(action)
    rejected = self.reject(call, ("python", "submit"), _USAGE)
    if rejected:
      return rejected
    tool, code = call[0], _strip_fence(call[1])
    if not code:
      return (f"Error: empty <{tool}> block.", {"format": -self.format_penalty}, False,
              {"tool_call": True, "tool_error": True})
    if tool == "python":
      result = self.sandbox.run(code)
      return render(result), {}, False, {"tool_call": True, "tool_error": not result.ok,
                                         "isolation": result.isolation}
    return self._submit(code)

  def _submit(self, code: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    tests = self.task.data["tests"]
    payload = json.dumps({"code": code, "cases": [json.loads(args) for args, _ in tests]})
    result = self.sandbox.run(_HARNESS, stdin=payload)
    outcomes = _parse_results(result.stdout, len(tests))
    passed = sum(o == ["ok", want] for o, (_, want) in zip(outcomes, tests))
    total = len(tests)
    if passed == total:
      observation = f"All {total} hidden tests passed."
    elif any(status for status, _ in outcomes):
      args, (status, value) = next((a, o) for o, (a, want) in zip(outcomes, tests)
                                   if o != ["ok", want])
      what = {"ok": f"returned {value}", "error": f"raised {value}"}.get(status, "gave no result")
      observation = (f"{passed}/{total} hidden tests passed. First failure: "
                     f"solve({args[1:-1]}) {what}.")
    else:
      observation = f"0/{total} hidden tests passed. {render(result)}"
    parts = {"outcome": float(passed == total),
             "process": self.partial_credit * passed / total}
    info = {"tool_call": True, "tool_error": not result.ok, "passed": passed, "total": total,
            "isolation": result.isolation}
    return observation, parts, True, info


def _strip_fence(code: str) -> str:
  """Models often wrap code in a markdown fence inside the tags."""
  code = code.strip()
  match = _FENCE.match(code)
  return match.group(1).strip() if match else code


def _parse_results(stdout: str, n: int) -> list[list[str]]:
  """The harness's [status, value] per case; ["", ""] where it gave none (the
  run failed) or something else (the submission printed a fake line)."""
  results = []
  for line in reversed(stdout.splitlines()):
    if line.startswith(_RESULTS):
      try:
        results = list(json.loads(line[len(_RESULTS):]))[:n]
      except ValueError:
        pass
      break
  valid = lambda o: (isinstance(o, list) and len(o) == 2 and o[0] in ("ok", "error")
                     and isinstance(o[1], str))
  return [o if valid(o) else ["", ""] for o in results] + [["", ""]] * (n - len(results))


def render(result: SandboxResult) -> str:
  """A run as the model sees it: what stopped it, then its output."""
  lines = []
  if result.killed_reason:
    lines.append(("Timed out" if result.timed_out else "Stopped") + f": {result.killed_reason}.")
  elif result.exit_code not in (0, None):
    lines.append(f"Exit code {result.exit_code}.")
  for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
    if text:
      lines.append(f"{name}:\n{text.rstrip()}")
  return "\n".join(lines) if lines else "(no output)"
