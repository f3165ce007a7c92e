"""Field checks shared by the config dataclasses (RolloutConfig, RLConfig,
LossConfig, OptimConfig): each states its own rules once, and an experiment
config's `validate` reports every broken one by its full name."""

from __future__ import annotations

from typing import Any, Sequence


class FieldError(ValueError):
  """Fields of one dataclass that no run could use."""

  def __init__(self, problems: Sequence[tuple[str, Any, str]]):
    self.problems = list(problems)  # (field, value, why)
    super().__init__("; ".join(f"{name} = {value!r} {why}"
                               for name, value, why in self.problems))


def check_fields(obj, rules: Sequence[tuple[str, bool, str]]) -> None:
  """Raises FieldError naming each (field, ok, why) rule that fails."""
  bad = [(name, getattr(obj, name), why) for name, ok, why in rules if not ok]
  if bad:
    raise FieldError(bad)
