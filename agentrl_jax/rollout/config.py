"""RolloutConfig: the rollout engine's settings (a config file's `rollout` section)."""

from __future__ import annotations

import dataclasses

from agentrl_jax.checks import check_fields


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  max_turns: int = 8
  max_action_tokens: int = 128  # per turn, at most the sampler's decode buffer
  max_observation_tokens: int = 256  # longer observations are cut, with a marker
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  env_workers: int = 16  # threads stepping environments concurrently
  # Seconds a reset or step may take before its episode ends as
  # "env_timeout" (None: wait forever); an environment's own `deadline_s`
  # attribute takes precedence.
  env_deadline_s: float | None = 60.0
  # Decode at most this many episodes per call (None: all that are ready).
  # Smaller calls let decoding of one cohort overlap the tool calls of
  # another when environments are slow: a tool call is hidden when the other
  # cohorts' decodes take as long (see benchmarks/rollout.py).
  max_decode_batch: int | None = None
  # Once an env call is back, wait up to this long for the rest of the calls
  # submitted with it, so a batch of tools returns to one decode instead of
  # trickling into many small ones.
  batch_wait_s: float = 0.005
  # Wait for every env call before each decode: batches (and so the random
  # numbers each episode draws) no longer depend on thread timing, which makes
  # runs bit-reproducible, at the cost of the tool/decode overlap.
  lockstep: bool = False
  system_prompt: str | None = None  # default: the environment's own
  # Sliding-window context policy: keep the prompt and the last k turns.
  # None: append-only (every turn stays in the cache; KV reuse).
  context_window: int | None = None
  max_context: int = 4096  # tokens per episode without a sampler (expert mode)
  # A prompt (system turn, tools and the reset observation, cut to
  # max_observation_tokens) must leave room for this many action tokens in
  # the context; one that does not is "drop"ped (its episodes counted in
  # ended/prompt_too_long, its task ids in one warning per call) or
  # refused ("error": the call raises, naming them).
  min_action_tokens: int = 1
  long_prompts: str = "drop"
  # Prompts fed together that begin with at least this many equal tokens
  # (every task's system turn and tools block) compute that prefix once and
  # copy its keys and values into each slot; later prompts of the same
  # rollout call that begin with it reuse it. 0: every prompt computed whole.
  min_shared_prefix: int = 32

  def __post_init__(self):
    check_fields(self, [
        ("max_turns", self.max_turns >= 1, "must be >= 1"),
        ("max_action_tokens", self.max_action_tokens >= 1, "must be >= 1"),
        ("env_workers", self.env_workers >= 1, "must be >= 1"),
        ("context_window", self.context_window is None or self.context_window >= 1,
         "must be None or >= 1"),
        ("min_action_tokens", self.min_action_tokens >= 1, "must be >= 1"),
        ("min_shared_prefix", self.min_shared_prefix >= 0, "must be >= 0"),
        ("long_prompts", self.long_prompts in ("drop", "error"), "must be 'drop' or 'error'"),
    ])
