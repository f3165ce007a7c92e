"""Calculator: arithmetic word problems solved with a safe calculator tool.

Problems are templated with 2- and 3-digit numbers so that the arithmetic
wants the tool; level = number of calculator steps - 1 (a level-2 problem
chains three steps, each feeding the next). The tool parses the expression
with `ast` and evaluates numbers and + - * / // % ** only: no names, calls or
attributes can run, and exponents and magnitudes are bounded so no
expression can eat the CPU or memory. `safe_eval(exact=True)` is the
exact (fractions, + - * / only) variant the arithmetic env's tool uses.
"""

from __future__ import annotations

import ast
import fractions
import math
import operator
import random
import re
from typing import Any, Callable

from agentrl_jax.envs.base import (Expert, Task, TextEnvironment, canonical_text, hashed_draws,
                                   tool_call)

SPLITS = ("train", "test")
MAX_EXPRESSION_CHARS = 200  # also bounds the recursion depth of `_evaluate`
MAX_EXPONENT = 100
MAX_ABS = 1e15
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.Pow: operator.pow}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
            ast.Mod: "%", ast.Pow: "**"}
_EXACT = (ast.Add, ast.Sub, ast.Mult, ast.Div)
# Exact literals are plain decimals: a Python literal such as 1e999999999
# would make `Fraction` build a billion-digit integer.
_DECIMAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_USAGE = ("<calc>expression</calc>", "<answer>number</answer>")


class CalcError(ValueError):
  """An expression the calculator refuses or cannot evaluate."""


def safe_eval(expression: str, *, exact: bool = False) -> int | float | fractions.Fraction:
  """Evaluates an arithmetic expression without `eval`; raises CalcError.

  Numbers, parentheses, unary + - and + - * / // % ** over Python numbers;
  with `exact`, + - * / only over fractions read from the literals' text
  (0.1 is 1/10), plain decimal literals only, denominators bounded too.
  """
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  source = expression.strip()
  try:
    tree = ast.parse(source, mode="eval")
  except (SyntaxError, ValueError) as e:  # ValueError: e.g. a null byte
    raise CalcError(f"invalid expression ({type(e).__name__})") from e
  ops = _EXACT if exact else tuple(_OPERATORS)
  return _evaluate(tree.body, source, ops)


def _evaluate(node: ast.AST, source: str, ops: tuple[type, ...]):
  exact = ops == _EXACT
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    value = node.value
    if exact:
      text = ast.get_source_segment(source, node) or ""
      if not _DECIMAL.fullmatch(text):
        raise CalcError(f"write numbers as plain decimals, not {text[:30]!r}")
      value = fractions.Fraction(text)
  elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    operand = _evaluate(node.operand, source, ops)
    value = -operand if isinstance(node.op, ast.USub) else operand
  elif isinstance(node, ast.BinOp) and type(node.op) in ops:
    left, right = _evaluate(node.left, source, ops), _evaluate(node.right, source, ops)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalcError(f"exponent larger than {MAX_EXPONENT}")
    try:
      value = _OPERATORS[type(node.op)](left, right)
    except ZeroDivisionError as e:
      raise CalcError("division by zero") from e
    except OverflowError as e:
      raise CalcError("result too large") from e
  else:
    what = ast.get_source_segment(source, node) or type(node).__name__
    allowed = " ".join(_SYMBOLS[op] for op in ops)
    raise CalcError(f"only numbers, parentheses and {allowed} are allowed, not {what[:30]!r}")
  if isinstance(value, complex):  # e.g. (-8) ** 0.5
    raise CalcError("complex result")
  # Every operand is bounded, so no single step builds a big number.
  if exact and (abs(value) > MAX_ABS or value.denominator > MAX_ABS):
    raise CalcError(f"a number past {MAX_ABS:g} in magnitude or denominator")
  if not exact and (not math.isfinite(value) or abs(value) > MAX_ABS):
    raise CalcError(f"result larger than {MAX_ABS:g} in magnitude")
  return value


def format_number(value: int | float) -> str:
  """Integral floats print as integers (84 / 2 = 42, not 42.0)."""
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  return str(value) if isinstance(value, int) else f"{value:.12g}"


def _parse_number(text: str) -> float | None:
  try:
    return float(text.strip().replace(",", ""))
  except ValueError:
    return None


# Templates: rng -> (problem text, calculator steps). Steps hold the concrete
# intermediate results, as the agent would see them in the observations.
def _bakery(r: random.Random) -> tuple[str, list[str]]:
  a, b = r.randint(12, 99), r.randint(12, 99)
  return (f"A bakery bakes {a} loaves every day. How many loaves does it bake "
          f"in {b} days?", [f"{a} * {b}"])


def _library(r: random.Random) -> tuple[str, list[str]]:
  a = r.randint(1000, 9999)
  b = r.randint(100, a - 1)
  return (f"A library had {a} books and lent out {b} of them. How many books "
          f"are still in the library?", [f"{a} - {b}"])


def _stickers(r: random.Random) -> tuple[str, list[str]]:
  children, each = r.randint(12, 60), r.randint(12, 99)
  return (f"{children * each} stickers are shared equally among {children} "
          f"children. How many stickers does each child get?",
          [f"{children * each} / {children}"])


def _shop(r: random.Random) -> tuple[str, list[str]]:
  boxes, per_box = r.randint(12, 60), r.randint(6, 24)
  sold = boxes * per_box
  stock = sold + r.randint(10, 500)
  return (f"A shop has {stock} apples. It sells {boxes} boxes of {per_box} "
          f"apples each. How many apples are left?",
          [f"{boxes} * {per_box}", f"{stock} - {sold}"])


def _train(r: random.Random) -> tuple[str, list[str]]:
  carriages, seats = r.randint(6, 30), r.randint(40, 90)
  total = carriages * seats
  empty = r.randint(10, total - 1)
  return (f"A train has {carriages} carriages with {seats} seats each. {empty} "
          f"seats are empty. How many passengers are seated?",
          [f"{carriages} * {seats}", f"{total} - {empty}"])


def _crates(r: random.Random) -> tuple[str, list[str]]:
  rows, trees, apples = r.randint(11, 40), r.randint(11, 40), r.randint(20, 90)
  crate = r.choice((6, 8, 12, 15, 24))
  total = rows * trees * apples
  return (f"An orchard has {rows} rows of {trees} trees. Each tree gives "
          f"{apples} apples, packed in crates of {crate}. How many crates can be "
          f"filled completely?",
          [f"{rows} * {trees}", f"{rows * trees} * {apples}", f"{total} // {crate}"])


def _school(r: random.Random) -> tuple[str, list[str]]:
  a, b, c, d = (r.randint(12, 99) for _ in range(4))
  return (f"A school buys {a} packs of {b} pencils and {c} packs of {d} pens. "
          f"How many pencils and pens does it buy in total?",
          [f"{a} * {b}", f"{c} * {d}", f"{a * b} + {c * d}"])


# level (= steps - 1) -> templates.
_TEMPLATES: dict[int, tuple[Callable[[random.Random], tuple[str, list[str]]], ...]] = {
    0: (_bakery, _library, _stickers), 1: (_shop, _train), 2: (_crates, _school)}


class CalculatorEnv(TextEnvironment):
  """Word problems; `<calc>expr</calc>` evaluates, `<answer>n</answer>` ends.

  Args:
    tolerance: an answer is correct if |answer - gold| <= tolerance *
      max(1, |gold|).
  """

  system_prompt = (
      "Solve the arithmetic word problem. Do every calculation with the "
      "calculator: write <calc>expression</calc> using numbers, parentheses "
      "and + - * / // % ** and the result comes back. When you have the final "
      "result, write <answer>number</answer>. You may reason first inside "
      "<think>...</think>.")
  stop_strings = ("</calc>", "</answer>")

  def __init__(self, *, tolerance: float = 1e-6, format_penalty: float = 0.0,
               step_cost: float = 0.0):
    super().__init__(format_penalty=format_penalty, step_cost=step_cost)
    self.tolerance = tolerance

  @classmethod
  def tasks(cls, split: str, n: int, seed: int, *,
            levels: tuple[int, ...] = (0, 1, 2)) -> list[Task]:
    """`n` distinct problems of `split` (a hash partition of the problem
    text: about 1 in 5 is a test problem), levels drawn uniformly."""
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    unknown = set(levels) - set(_TEMPLATES)
    if unknown or not levels:
      raise ValueError(f"unknown levels {sorted(unknown)}; known: {sorted(_TEMPLATES)}")
    draws = hashed_draws(split, n, seed,
                         lambda rng: rng.choice(_TEMPLATES[rng.choice(levels)])(rng))
    return [Task(f"calc/{digest[:16]}", text,
                 {"answer": int(safe_eval(steps[-1])), "steps": tuple(steps)}, len(steps) - 1)
            for text, digest, steps in draws]

  @classmethod
  def expert(cls, task: Task) -> Expert:
    """Runs each step on the calculator, then answers."""
    actions = iter([f"<calc>{s}</calc>" for s in task.data["steps"]]
                   + [f"<answer>{format_number(task.data['answer'])}</answer>"])
    return lambda observation: next(actions)

  def _reset(self, task: Task) -> str:
    return f"Problem: {task.prompt}"

  def state_key(self, observation: str) -> str:
    """The observation: the calculator keeps no state between calls."""
    return canonical_text(observation)

  def _step(self, action: str) -> tuple[str, dict[str, float], bool, dict[str, Any]]:
    call = tool_call(action)
    rejected = self.reject(call, ("calc", "answer"), _USAGE)
    if rejected:
      return rejected
    tool, argument = call[0], call[1].strip()
    if tool == "answer":
      gold, value = self.task.data["answer"], _parse_number(argument)
      correct = value is not None and abs(value - gold) <= self.tolerance * max(1.0, abs(gold))
      return ("Correct." if correct else "Incorrect.", {"outcome": float(correct)}, True,
              {"correct": correct})
    try:
      result = safe_eval(argument)
    except CalcError as e:
      return (f"Error: {e}.", {"format": -self.format_penalty}, False,
              {"tool_call": True, "tool_error": True})
    return f"{argument} = {format_number(result)}", {}, False, {"tool_call": True}
