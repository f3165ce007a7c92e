"""Arithmetic: multi-step word problems solved with a JSON `calculate` tool.

`arithmetic_env(**kwargs)` ("arithmetic" in the registry) is a `ToolEnv`
for chat formats that render tools (`qwen2.5`). Problems (`tasks`) chain 2-4
operations on 2-4-digit numbers in several settings (shopping, distances,
inventories, harvests, savings); level = operations - 2, and every
intermediate and final result is a positive integer. Splits are a hash of
the problem text (`hashed_split`), so train and test never share a problem.

`calculate(expression)` evaluates numbers, + - * / and parentheses exactly
(`evaluate`: `ast` walked node by node, never `eval`), over fractions: a
result that is not whole comes back as a reduced fraction ("7/2"), which
reads back in as the same value. Literals, results and denominators are
bounded by `MAX_ABS` and expressions by `MAX_EXPRESSION_CHARS`, so nothing
can hang. A refused expression raises `CalcError`; `ToolEnv` turns it into
an error observation. The final answer is a turn without a call holding the
number alone ("8460"); `exact_answer` gives 1 for exactly the gold value.
"""

from __future__ import annotations

import fractions
import functools
import random
import re
from typing import Callable, Union

from agentrl_jax import tools as tools_lib
from agentrl_jax.envs.base import Expert, Task, TextEnvironment, hashed_draws
from agentrl_jax.envs.calculator import safe_eval
from agentrl_jax.envs.tool_env import ToolEnv

SPLITS = ("train", "test")
NO_TOOL_SYSTEM_PROMPT = (
    "Solve the word problem. Reply with the final number alone.")
SYSTEM_PROMPT = (
    "Solve the word problem. Do every calculation with the calculate tool; it takes "
    "numbers, + - * / and parentheses. When you have the final result, reply with the "
    "number alone, without a tool call.")
_ANSWER = re.compile(r"[+-]?\d{1,20}(?:\.\d{1,20})?")


def evaluate(expression: str) -> fractions.Fraction:
  """The exact value of `expression` (numbers, + - * /, unary + -,
  parentheses): `calculator.safe_eval(exact=True)`; raises CalcError for
  anything else, a division by zero, or a literal, result or denominator
  past `MAX_ABS`."""
  return safe_eval(expression, exact=True)


# The docstring is the schema the model reads: its description stays on one
# line, since get_json_schema keeps line breaks.
def calculate(expression: str) -> str:  # pylint: disable=line-too-long
  """Evaluates an arithmetic expression exactly: numbers, + - * / and parentheses. A result that is not whole comes back as a fraction, e.g. 7/2.

  Args:
    expression: The expression, e.g. "(12 + 30) * 4".
  """
  return str(evaluate(expression))  # "42" or a reduced "-7/2": reads back exactly


@functools.cache
def _calculate_tool() -> tools_lib.Tool:
  """Built once: the schema comes from transformers, and every episode
  builds an environment."""
  return tools_lib.tool(calculate)


def exact_answer(task: Task, answer: str) -> float:
  """1.0 when `answer` is a plain decimal number ("8460", "8460.0", an
  optional trailing period) equal to the gold answer, else 0.0."""
  text = answer.strip().removesuffix(".")
  if not _ANSWER.fullmatch(text):
    return 0.0
  return float(fractions.Fraction(text) == task.data["answer"])


# ---------------------------------------------------------------- problems

# An expression tree: a number, or (operator, left, right) with operator in
# "+-*/". Templates build one; steps, the one-line expression and the gold
# answer all come from it, so they cannot disagree.
Tree = Union[int, tuple]
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun")
_GOODS = ("notebooks", "lamps", "mugs", "shirts", "books", "chairs", "kettles", "scarves")
_STOCK = ("cans", "bolts", "bottles", "boxes", "parts", "rolls")


def _change(r: random.Random) -> tuple[str, Tree]:
  name, item, a, p = r.choice(_NAMES), r.choice(_GOODS), r.randint(12, 99), r.randint(11, 99)
  paid = min(9999, (a * p // 100 + r.randint(1, 5)) * 100)
  return (f"{name} buys {a} {item} at {p} dollars each and pays with {paid} dollars. "
          f"How many dollars of change does {name} get?", ("-", paid, ("*", a, p)))


def _trip(r: random.Random) -> tuple[str, Tree]:
  km, days, extra = r.randint(25, 480), r.randint(12, 60), r.randint(10, 999)
  return (f"A van drives {km} km every day for {days} days, then {extra} km more to "
          f"return to its depot. How many km does it drive in total?",
          ("+", ("*", km, days), extra))


def _share(r: random.Random) -> tuple[str, Tree]:
  each, stores, thing = r.randint(20, 400), r.randint(12, 24), r.choice(_STOCK)
  sold = r.randint(10, each - 1)
  return (f"A warehouse splits {each * stores} {thing} equally among {stores} stores. "
          f"Each store then sells {sold} {thing}. How many {thing} does each store have "
          f"left?", ("-", ("/", each * stores, stores), sold))


def _cart(r: random.Random) -> tuple[str, Tree]:
  name, (x, y) = r.choice(_NAMES), r.sample(_GOODS, 2)
  a, p, b, q = r.randint(11, 60), r.randint(10, 99), r.randint(11, 60), r.randint(10, 99)
  return (f"{name} buys {a} {x} at {p} dollars each and {b} {y} at {q} dollars each. "
          f"How many dollars does {name} spend?", ("+", ("*", a, p), ("*", b, q)))


def _race(r: random.Random) -> tuple[str, Tree]:
  a, n = r.randint(40, 150), r.randint(20, 60)
  b, m = r.randint(10, a - 1), r.randint(10, n - 1)  # fewer and shorter: positive
  return (f"A cyclist rides {a} km a day for {n} days. A runner covers {b} km a day for "
          f"{m} days. How many more km does the cyclist cover than the runner?",
          ("-", ("*", a, n), ("*", b, m)))


def _restock(r: random.Random) -> tuple[str, Tree]:
  thing, have = r.choice(_STOCK), r.randint(100, 2000)
  crates, per = r.randint(12, 50), r.randint(12, 48)
  sold = r.randint(10, min(9999, have + crates * per - 1))
  return (f"A store has {have} {thing}. It receives {crates} crates of {per} {thing} "
          f"and sells {sold} {thing}. How many {thing} does it have now?",
          ("-", ("+", have, ("*", crates, per)), sold))


def _harvest(r: random.Random) -> tuple[str, Tree]:
  bag, orchards = r.randint(10, 25), r.randint(11, 40)
  kg = bag * r.randint(2, 40)  # whole bags
  kept = r.randint(10, kg * orchards // bag - 1)
  return (f"A farm picks {kg} kg of apples in each of its {orchards} orchards and packs "
          f"them in bags of {bag} kg. It keeps {kept} bags. How many bags does it sell?",
          ("-", ("/", ("*", kg, orchards), bag), kept))


def _savings(r: random.Random) -> tuple[str, Tree]:
  name, wage = r.choice(_NAMES), r.randint(100, 900)
  weeks, jars = r.randint(10, 52), r.randint(10, 20)
  earned = wage * weeks
  spent = r.randint(10, min(9000, earned // 2))
  spent += (earned - spent) % jars  # the rest splits evenly
  return (f"{name} earns {wage} dollars a week for {weeks} weeks, spends {spent} dollars "
          f"and splits the rest equally among {jars} jars. How many dollars go in each "
          f"jar?", ("/", ("-", ("*", wage, weeks), spent), jars))


def _change_two(r: random.Random) -> tuple[str, Tree]:
  name, (x, y) = r.choice(_NAMES), r.sample(_GOODS, 2)
  a, p, b, q = r.randint(11, 40), r.randint(10, 99), r.randint(11, 40), r.randint(10, 99)
  paid = min(9999, ((a * p + b * q) // 100 + r.randint(1, 5)) * 100)
  return (f"{name} buys {a} {x} at {p} dollars each and {b} {y} at {q} dollars each, and "
          f"pays with {paid} dollars. How many dollars of change does {name} get?",
          ("-", paid, ("+", ("*", a, p), ("*", b, q))))


def _fuel(r: random.Random) -> tuple[str, Tree]:
  km, trips, days = r.randint(12, 90), r.randint(10, 20), r.randint(10, 30)
  per, depot = r.randint(10, 16), r.randint(10, 900)
  depot += -(km * trips * days + depot) % per  # whole litres
  return (f"A bus drives {km} km per trip and makes {trips} trips a day for {days} days. "
          f"It also drives {depot} km to and from the depot. It uses one litre of fuel "
          f"every {per} km. How many litres of fuel does it use?",
          ("/", ("+", ("*", ("*", km, trips), days), depot), per))


def _warehouse(r: random.Random) -> tuple[str, Tree]:
  thing, have = r.choice(_STOCK), r.randint(500, 5000)
  a, b = r.randint(10, 40), r.randint(12, 60)
  c, d = r.randint(10, a), r.randint(12, b)  # ships at most what came in: positive
  return (f"A warehouse holds {have} {thing}. It receives {a} pallets of {b} {thing} and "
          f"ships {c} boxes of {d} {thing}. How many {thing} does it hold now?",
          ("-", ("+", have, ("*", a, b)), ("*", c, d)))


# operations -> templates.
_TEMPLATES: dict[int, tuple[Callable[[random.Random], tuple[str, Tree]], ...]] = {
    2: (_change, _trip, _share), 3: (_cart, _race, _restock, _harvest, _savings),
    4: (_change_two, _fuel, _warehouse)}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _steps(tree: Tree, out: list[str]) -> int:
  """Appends one "a op b" expression per operation (post-order, concrete
  operands); returns the tree's value."""
  if isinstance(tree, int):
    return tree
  op, left, right = tree
  a, b = _steps(left, out), _steps(right, out)
  out.append(f"{a} {op} {b}")
  value = evaluate(out[-1])
  assert value.denominator == 1 and value > 0, (tree, value)  # templates keep it so
  return int(value)


def _infix(tree: Tree) -> str:
  """The tree as one expression with only the parentheses it needs."""
  if isinstance(tree, int):
    return str(tree)
  op, left, right = tree
  parts = []
  for side, child in (("left", left), ("right", right)):
    text = _infix(child)
    if isinstance(child, tuple) and (_PRECEDENCE[child[0]] < _PRECEDENCE[op] or (
        side == "right" and _PRECEDENCE[child[0]] == _PRECEDENCE[op] and op in "-/")):
      text = f"({text})"
    parts.append(text)
  return f"{parts[0]} {op} {parts[1]}"


def tasks(split: str, n: int, seed: int, *, operations: tuple[int, ...] = (2, 3, 4)
          ) -> list[Task]:
  """`n` distinct problems of `split` (a hash partition of the problem text:
  about 1 in 5 is a test problem), the number of operations drawn uniformly
  from `operations`. `Task.data`: "answer" (int), "steps" (one "a op b" per
  operation, in the expert's order) and "expression" (the whole problem as
  one expression)."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
  unknown = set(operations) - set(_TEMPLATES)
  if unknown or not operations:
    raise ValueError(f"unknown operations {sorted(unknown)}; known: {sorted(_TEMPLATES)}")

  def draw(rng: random.Random) -> tuple[str, tuple[int, Tree]]:
    ops = rng.choice(operations)
    text, tree = rng.choice(_TEMPLATES[ops])(rng)
    return text, (ops, tree)

  out = []
  for text, digest, (ops, tree) in hashed_draws(split, n, seed, draw):
    steps: list[str] = []
    answer = _steps(tree, steps)
    out.append(Task(f"arith/{digest[:16]}", text, {
        "answer": answer, "steps": tuple(steps), "expression": _infix(tree)}, ops - 2))
  return out


def expert(task: Task) -> Expert:
  """One `calculate` call per operation, each with the previous results as
  numbers (a turn per call, so each result is read before it is used), then
  the answer alone."""
  actions = iter([tools_lib.render_call("calculate", {"expression": s})
                  for s in task.data["steps"]] + [str(task.data["answer"])])
  return lambda observation: next(actions)


class NoToolArithmetic(TextEnvironment):
  """The same problems answered without a tool, in one turn: the baseline a
  calculator must beat (`arithmetic_env(with_tool=False)`)."""

  system_prompt = NO_TOOL_SYSTEM_PROMPT
  stop_strings = ()

  def _reset(self, task: Task) -> str:
    return task.prompt

  def _step(self, action: str):
    return "", {"outcome": exact_answer(self.task, action)}, True, {}

  @staticmethod
  def tasks(split: str, n: int, seed: int, **kwargs) -> list[Task]:
    return tasks(split, n, seed, **kwargs)


def arithmetic_env(*, with_tool: bool = True, **kwargs):
  """The arithmetic `ToolEnv`; kwargs go to it (format_penalty, call_cost,
  ...). Needs a chat format that renders tools, e.g.
  `--config.env.chat_format=qwen2.5`, and `rollout.max_turns >= 5` for the
  four-operation problems' expert. `with_tool=False`: `NoToolArithmetic`,
  the problems answered in one turn without the tool (no expert)."""
  if not with_tool:
    return NoToolArithmetic(**kwargs)
  kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
  return ToolEnv(tools=[_calculate_tool()], reward_fn=exact_answer, tasks=tasks, expert=expert,
                 **kwargs)
