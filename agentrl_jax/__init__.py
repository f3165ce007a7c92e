"""agentrl_jax: multi-turn, tool-using (agentic) RL for language models in JAX."""

import os

# We use transformers for configs and tokenizers only, never its PyTorch
# models: its "PyTorch was not found" advice at import is not for our users.
# (Set before any submodule imports transformers; an explicit value wins.)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# pylint: disable=wrong-import-position
from agentrl_jax import advantages, distributed, losses, masked, sharding, trajectory
from agentrl_jax.advantages import (
    branching_advantages, broadcast_trajectory_values, discounted_returns,
    gae_over_turns, group_normalize_turns, grpo_advantages, paint_turn_values,
    rloo_advantages)
from agentrl_jax.losses import (
    aggregate_loss, entropy, kl_penalty, policy_loss, token_logprobs)
from agentrl_jax.masked import masked_mean, masked_sum, masked_whiten
from agentrl_jax.trajectory import (
    Role, Segment, Step, TokenBatch, Trajectory, collate, truncate_to,
    turn_arrays)

__version__ = "0.1.0"
