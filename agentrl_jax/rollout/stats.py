"""What one rollout call measured, and its metrics (`RolloutResult.metrics`)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from agentrl_jax.rollout.episode import STOP_REASONS
from agentrl_jax.trajectory import Role, Trajectory


@dataclasses.dataclass
class RunStats:
  """Counters the scheduler adds to during one call."""
  abandoned: int = 0  # the engine's count of abandoned calls when the call began
  env_wait: float = 0.0  # seconds waiting for env calls
  generation: float = 0.0  # seconds sampling actions
  fed_tokens: int = 0  # prompt and observation tokens the sampler computed
  generated_tokens: int = 0
  decode_calls: int = 0
  occupancy: float = 0.0  # summed over decode calls: the share of slots decoded

  def summary(self, trajs: list[Trajectory], failed: list[dict],
              latencies: list[float], abandoned: int) -> dict[str, float]:
    """The call's metrics; `ended/<reason>` counts episodes (failed ones
    included) per stop reason, `env_call_*_s` are per env call, and
    `env_calls_abandoned` counts the calls this run abandoned."""
    n = max(len(trajs), 1)
    turns = [t.metadata["n_turns"] for t in trajs] or [0]
    stale = [t.metadata["staleness"] for t in trajs] or [0]
    calls = sum(t.metadata["tool_calls"] for t in trajs)
    reasons = collections.Counter(
        [t.metadata["stop_reason"] for t in trajs] + [f["stop_reason"] for f in failed])
    p50, p95, top = (np.percentile(latencies, [50, 95, 100]) if latencies
                     else (0.0, 0.0, 0.0))
    return {
        "episodes": float(len(trajs)),
        "turns_mean": float(np.mean(turns)), "turns_max": float(np.max(turns)),
        "action_tokens_mean": float(np.mean(
            [sum(len(s) for s in t.segments if s.role == Role.ASSISTANT)
             for t in trajs] or [0])),
        "terminated_frac": sum(t.terminated for t in trajs) / n,
        "truncated_frac": sum(t.truncated for t in trajs) / n,
        "success_frac": sum(t.metadata["success"] for t in trajs) / n,
        "reward_mean": float(np.mean([t.reward for t in trajs] or [0.0])),
        "tool_calls_per_turn": calls / max(sum(turns), 1),
        "tool_error_rate": sum(t.metadata["tool_errors"] for t in trajs) / max(calls, 1),
        # Turns whose action the environment answered as malformed (info["malformed"]).
        "malformed_turn_frac": sum(t.metadata["malformed"] for t in trajs) / max(sum(turns), 1),
        "staleness_mean": float(np.mean(stale)), "staleness_max": float(np.max(stale)),
        **{f"ended/{r}": float(reasons[r]) for r in STOP_REASONS},
        "env_call_p50_s": float(p50), "env_call_p95_s": float(p95),
        "env_call_max_s": float(top), "env_calls_abandoned": float(abandoned),
        "env_wait_s": self.env_wait, "generation_s": self.generation,
        "sampler_fed_tokens": float(self.fed_tokens),
        "slot_occupancy": self.occupancy / max(self.decode_calls, 1),
    }
