"""A tour of the core maths on synthetic multi-turn trajectories.

Runs in a few seconds on a CPU:

  python experiments/demo_core.py --group_size=4 --num_tasks=3

It builds G rollouts per task with random actions, observations and per-turn
rewards, assigns credit three ways (trajectory-level GRPO, turn-level
returns-to-go, GAE over turns with a zero critic), collates the trajectories
into a padded and a packed batch, and evaluates the masked clipped surrogate
under the tiny random Llama decoder on both: packed rows attend only within
their own trajectory, so the two losses must agree.
"""

from absl import app, flags
from flax import nnx
import jax.numpy as jnp
import numpy as np

from agentrl_jax import advantages, losses, models
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate, turn_arrays

_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "Rollouts per task (G).")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 3, "Tasks per batch.")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 4, "Turn budget per episode.")
_GAMMA = flags.DEFINE_float("gamma", 0.9, "Discount between turns.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")

VOCAB = models.tiny_config().vocab_size


def synthetic_rollout(rng: np.random.Generator, max_turns: int) -> Trajectory:
  """An episode: prompt, then actions and observations, per-turn rewards."""
  segments = [Segment(Role.SYSTEM, rng.integers(0, VOCAB, 6))]
  n_turns = int(rng.integers(1, max_turns + 1))
  rewards = []
  for t in range(n_turns):
    action = rng.integers(0, VOCAB, int(rng.integers(2, 6)))
    segments.append(Segment(Role.ASSISTANT, action,
                            np.log(rng.uniform(0.05, 1.0, len(action)))))
    rewards.append(float(rng.uniform() < 0.3) if t < n_turns - 1 else 0.0)
    if t < n_turns - 1:
      segments.append(Segment(Role.OBSERVATION, rng.integers(0, VOCAB, 5)))
  terminated = n_turns < max_turns or rng.uniform() < 0.5
  rewards[-1] = float(terminated and rng.uniform() < 0.5)
  return Trajectory(segments, reward=sum(rewards), turn_rewards=rewards,
                    terminated=terminated, truncated=not terminated)


def main(argv):
  del argv
  rng = np.random.default_rng(_SEED.value)
  group, n_tasks = _GROUP_SIZE.value, _NUM_TASKS.value
  trajs = [synthetic_rollout(rng, _MAX_TURNS.value)
           for _ in range(group * n_tasks)]
  group_ids = jnp.repeat(jnp.arange(n_tasks), group)
  rewards = jnp.asarray([t.reward for t in trajs])
  turn_rewards, turn_mask = turn_arrays(trajs, num_turns=_MAX_TURNS.value)
  terminated = jnp.asarray([t.terminated for t in trajs])

  traj_adv = advantages.grpo_advantages(rewards, group_ids)
  returns = advantages.discounted_returns(turn_rewards, turn_mask, _GAMMA.value)
  gae, _ = advantages.gae_over_turns(
      turn_rewards, jnp.zeros_like(turn_rewards), turn_mask, terminated,
      _GAMMA.value, 0.95, jnp.zeros(len(trajs)))

  print(f"{len(trajs)} trajectories ({n_tasks} tasks x G={group}), "
        f"{sum(t.num_turns for t in trajs)} turns, "
        f"{sum(len(t) for t in trajs)} tokens")
  print(f"{'traj':>4} {'turns':>5} {'end':>10} {'R':>5} {'GRPO A':>7}  "
          "returns-to-go per turn")
  for i, t in enumerate(trajs):
    end = "terminated" if t.terminated else "truncated"
    rtg = " ".join(f"{x:5.2f}" for x in np.asarray(returns[i, :t.num_turns]))
    print(f"{i:4d} {t.num_turns:5d} {end:>10} {t.reward:5.2f} "
          f"{float(traj_adv[i]):7.3f}  {rtg}")

  padded = collate(trajs, buckets=(32, 64))
  packed = collate(trajs, buckets=(32, 64), pack=True)
  policy = models.Decoder(models.tiny_config(), rngs=nnx.Rngs(_SEED.value))
  forward = nnx.jit(lambda m, b: m(b.tokens, b.positions, b.seq_ids))

  def loss_on(batch, per_turn):
    logp = losses.token_logprobs(forward(policy, batch), batch.tokens)
    if per_turn is None:
      adv = advantages.broadcast_trajectory_values(
          traj_adv, batch.seq_ids, batch.turn_index)
    else:
      adv = advantages.paint_turn_values(per_turn, batch.seq_ids,
                                         batch.turn_index)
    loss, metrics = losses.policy_loss(
        logp, batch.old_logprobs, adv, batch.loss_mask,
        agg="seq-mean-token-mean", seq_ids=batch.seq_ids)
    return float(loss), float(metrics["clip_frac_upper"] + metrics["clip_frac_lower"])

  print(f"\npadded batch {padded.tokens.shape}, packed batch "
        f"{packed.tokens.shape}; action tokens: {int(padded.loss_mask.sum())}")
  for name, per_turn in [("trajectory GRPO", None), ("turn returns", returns),
                         ("GAE over turns", gae)]:
    (lp, cp), (lk, _) = loss_on(padded, per_turn), loss_on(packed, per_turn)
    print(f"{name:>16}: loss padded {lp:+.6f}  packed {lk:+.6f}  "
          f"clip fraction {cp:.3f}")
    np.testing.assert_allclose(lp, lk, rtol=1e-5)
  print("\npadded and packed losses agree.")


if __name__ == "__main__":
  app.run(main)
