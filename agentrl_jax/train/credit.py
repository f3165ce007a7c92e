"""Credit assignment by name: rollouts + collated batch -> per-token advantages.

A scheme is a function from a frozen `CreditInputs` (what credit may depend
on) to a `Credit` (per-trajectory or per-turn advantages, and value targets
where a critic trains); `assign` builds the inputs and paints the result
onto the tokens. Schemes register by name with `@register(name)`, the
built-ins below exactly as a user's would, and a config names any
registered scheme (`schemes()`):

  grpo          trajectory-level group-relative, population std (GRPO)
  drgrpo        the same without the std division (Dr.GRPO)
  rloo          leave-one-out baseline
  turn_returns  per-turn discounted return-to-go on each turn's tokens
  turn_grpo     returns-to-go normalised over each task's group of turns
  gae           GAE over turns with the policy's value head (needs values)
  branching     critic-free per-turn TD advantages with Monte-Carlo values
                V(s_t) from continuations sampled at each turn
                (`RolloutEngine.branch`, `branch_returns`)
  gigpo         GRPO plus turn-level advantages over the turns the group's
                rollouts took from the same state (GiGPO, omega = 1; the
                environment's info["state_key"]: `gigpo`)

A scheme of one's own, e.g. in an experiment's config file:

  @credit.register("turn_rloo")
  def turn_rloo(x: credit.CreditInputs) -> credit.Credit:
    ...
    return credit.Credit(turns=...)  # [N, T]

Trajectory rewards are the episode returns; turn rewards are the per-step
rewards the environment reported (outcome, format, cost and process parts).
`assign(..., whiten=True)` whitens any scheme's painted advantages over the
batch's action tokens (`advantages.whiten_token_advantages`; veRL does so
for GAE); value targets stay as the scheme gave them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax import advantages as adv
from agentrl_jax.train.step import decision_mask
from agentrl_jax.trajectory import TokenBatch, Trajectory, turn_arrays


@dataclasses.dataclass(frozen=True)
class CreditInputs:
  """What a credit scheme may depend on, for N trajectories of up to T turns."""

  trajectories: tuple[Trajectory, ...]  # in the order of their seq ids
  rewards: jax.Array  # [N] float32 episode returns
  turn_rewards: np.ndarray  # [N, T] float32 per-turn rewards
  turn_mask: np.ndarray  # [N, T] float32, 1 on the turns an episode has
  group_ids: jax.Array  # [N] int32, equal for the rollouts of one task
  terminated: jax.Array  # [N] bool: ended by the environment
  truncated: jax.Array  # [N] bool: cut by a budget (the state has a value)
  gamma: float  # turn discount
  lam: float  # GAE lambda
  # Schemes registered with needs_values: V(s_t) read from the value head at
  # each turn's decision state, and V after the last turn (0 if it ended).
  values: np.ndarray | None = None  # [N, T]
  bootstrap: np.ndarray | None = None  # [N]
  # Schemes registered with needs_branches: Monte-Carlo returns of the state
  # before each turn (`branch_returns`): ([N, T, K], mask [N, T, K]).
  branch_returns: tuple[np.ndarray, np.ndarray] | None = None
  # Per trajectory, the environment's key of the state each turn was taken
  # in (info["state_key"]; None where it reports none). Schemes that group
  # turns by state (gigpo) need one tuple per trajectory (`anchor_groups`
  # raises otherwise); `assign` fills them from metadata["state_keys"].
  state_keys: tuple[tuple[Hashable | None, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class Credit:
  """A scheme's output: one of `trajectory` [N] (painted on every action
  token of the trajectory) or `turns` [N, T] (on each turn's tokens), and
  optionally `returns` [N, T], the value head's targets at each turn's
  decision state."""

  trajectory: Any = None
  turns: Any = None
  returns: Any = None


@dataclasses.dataclass(frozen=True)
class Scheme:
  name: str
  fn: Callable[[CreditInputs], Credit]
  needs_values: bool  # the trainer runs the value head before credit
  needs_branches: bool  # the trainer samples continuations at every turn


_SCHEMES: dict[str, Scheme] = {}


def register(name: str, *, needs_values: bool = False, needs_branches: bool = False,
             replace: bool = False):
  """Decorator: registers `fn(CreditInputs) -> Credit` as credit scheme `name`.

  replace: redefine an existing scheme (e.g. rerunning a notebook cell);
    otherwise a taken name is an error.
  """
  def add(fn: Callable[[CreditInputs], Credit]):
    if name in _SCHEMES and not replace:
      raise ValueError(f"credit scheme {name!r} is already registered "
                       "(pass replace=True to redefine it)")
    _SCHEMES[name] = Scheme(name, fn, needs_values, needs_branches)
    return fn
  return add


def schemes() -> tuple[str, ...]:
  """The registered scheme names, built-ins first."""
  return tuple(_SCHEMES)


def scheme(name: str) -> Scheme:
  if name not in _SCHEMES:
    raise ValueError(f"unknown credit scheme {name!r}; known: {schemes()}")
  return _SCHEMES[name]


def group_ids_of(trajs: Sequence[Trajectory]) -> np.ndarray:
  return np.asarray([t.metadata["group_id"] for t in trajs], np.int32)


def turn_values_from_tokens(token_values: np.ndarray, batch: TokenBatch,
                            num_trajs: int, num_turns: int
                            ) -> tuple[np.ndarray, np.ndarray]:
  """Reads V(s_t) at each turn's decision position, and V after the last turn.

  Returns (values [N, T], bootstrap [N]): the value head at the token before
  each turn's first action (in the context that action was sampled in), and
  at each trajectory's last token when that is not an action token: a
  truncated episode ends on the observation after its last action and the
  next assistant header (the state after its last turn; under a sliding
  window, read in the window the next action would have seen: the view with
  no trained tokens when the window moved, else the view holding its last
  turn), the same kind of position the value head is trained at. An episode
  that ends on an action has no next state (it terminated, or the next
  observation did not fit the context, so nothing could follow): bootstrap 0.
  """
  seq_ids, turn_index = batch.seq_ids, batch.turn_index
  on = np.asarray(decision_mask(jnp.asarray(turn_index))) & (seq_ids >= 0)
  values = np.zeros((num_trajs, num_turns), np.float32)
  rows, cols = np.nonzero(on)
  values[seq_ids[rows, cols], turn_index[rows, cols + 1]] = token_values[rows, cols]
  real = seq_ids >= 0
  same_as_prev = np.pad(real[:, 1:] & (seq_ids[:, 1:] == seq_ids[:, :-1]),
                        ((0, 0), (1, 0)))
  # Runs of one seq id in a row are sequences (views never share a row).
  run_id = np.cumsum(real & ~same_as_prev).reshape(seq_ids.shape) - 1
  run_turn = np.full(int(run_id.max(initial=-1)) + 1, -1)
  np.maximum.at(run_turn, run_id[real], turn_index[real])
  last = real & ~np.pad(same_as_prev[:, 1:], ((0, 0), (0, 1)))
  bootstrap = np.zeros(num_trajs, np.float32)
  best = np.full(num_trajs, -2)
  for r, c in zip(*np.nonzero(last)):
    i, turn = seq_ids[r, c], run_turn[run_id[r, c]]
    if turn < 0:  # the final state's own view (no trained tokens) wins
      turn = num_turns
    if turn > best[i]:
      best[i] = turn
      bootstrap[i] = token_values[r, c] if turn_index[r, c] < 0 else 0.0
  return values, bootstrap


def anchor_groups(group_ids: np.ndarray, state_keys: Sequence[Sequence[Hashable | None]],
                  num_turns: int) -> np.ndarray:
  """[N, T] int32 step-group ids: equal for the turns of one task group
  taken from states with equal keys; unique for a turn without a key.

  state_keys: one tuple per trajectory (a missing one would leave its turns
    in one group with every other trajectory's: ValueError).
  """
  if len(state_keys) != len(group_ids):
    raise ValueError(f"state_keys: {len(state_keys)} key tuples for {len(group_ids)} "
                     "trajectories; pass one per trajectory (CreditInputs.state_keys, "
                     "from metadata['state_keys']; None where a state has no key)")
  ids: dict[tuple[int, Hashable], int] = {}
  out = np.zeros((len(group_ids), num_turns), np.int32)
  for i, keys in enumerate(state_keys):
    for t in range(num_turns):
      key = keys[t] if t < len(keys) else None
      anchor = (int(group_ids[i]), key) if key is not None else ("no key", i, t)
      out[i, t] = ids.setdefault(anchor, len(ids))
  return out


def _return_to_go(traj: Trajectory, t: int, gamma: float) -> float:
  rewards, _ = turn_arrays([traj])
  return float(sum(gamma ** k * r for k, r in enumerate(rewards[0, t:])))


def branch_returns(trajs: Sequence[Trajectory],
                   branches: dict[tuple[int, int], Sequence[Trajectory]], *,
                   gamma: float = 1.0, num_turns: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Monte-Carlo samples of V(s_t) for `advantages.branching_advantages`.

  The samples of the state before trajectory i's turn t are its own return
  from t on, plus: at t = 0, the returns of the other members of its group
  (they all start from the task's initial state); at t >= 1, the returns
  from t of `branches[(i, t)]`, continuations sampled from that state.

  Returns (returns [N, T, K], mask [N, T, K]), K the most samples of a state.
  """
  turn_rewards, turn_mask = turn_arrays(trajs, num_turns)
  own = np.asarray(adv.discounted_returns(turn_rewards, turn_mask, gamma))
  groups = group_ids_of(trajs)
  samples: dict[tuple[int, int], list[float]] = {}
  for i, traj in enumerate(trajs):
    if traj.num_turns:
      samples[i, 0] = list(own[groups == groups[i], 0])
    for t in range(1, traj.num_turns):
      samples[i, t] = [own[i, t]] + [_return_to_go(c, t, gamma)
                                     for c in branches.get((i, t), ())]
  width = max([len(v) for v in samples.values()] + [1])
  returns = np.zeros((*own.shape, width), np.float32)
  mask = np.zeros((*own.shape, width), np.float32)
  for (i, t), values in samples.items():
    returns[i, t, :len(values)] = values
    mask[i, t, :len(values)] = 1.0
  return returns, mask


def assign(name: str, trajs: Sequence[Trajectory], batch: TokenBatch, *,
           gamma: float = 1.0, lam: float = 0.95, num_turns: int | None = None,
           token_values: np.ndarray | None = None,
           branch_values: tuple[np.ndarray, np.ndarray] | None = None,
           whiten: bool = False) -> TokenBatch:
  """Fills `batch.advantages` (and `batch.returns` where the scheme gives them).

  Args:
    name: a registered scheme (`schemes()`).
    trajs: the N trajectories `batch` was collated from (same order), with
      `metadata["group_id"]`.
    gamma, lam: turn discount and GAE lambda.
    num_turns: T of the [N, T] turn arrays (default: the longest episode).
    token_values: [B, L] value-head outputs on `batch` (schemes that need
      values).
    branch_values: (returns [N, T, K], mask [N, T, K]) from `branch_returns`
      (schemes that need branches). The bootstrap after a truncated episode
      is 0 there: its continuations ran under the same turn budget, so their
      returns stop there too.
    whiten: whiten the advantages over the action tokens of `batch` (real,
      loss_mask 1): (A - mean) / sqrt(var + 1e-8), token-weighted, unbiased
      var (`advantages.whiten_token_advantages`; veRL's default for GAE).
      The statistics are this batch's: under several processes, each
      process's rows; before the trainer drops or masks any tokens.
  """
  s = scheme(name)
  turn_rewards, turn_mask = turn_arrays(trajs, num_turns)
  values = bootstrap = None
  if s.needs_values:
    if token_values is None:
      raise ValueError(f"credit scheme {name!r} needs token_values from the value head")
    values, bootstrap = turn_values_from_tokens(token_values, batch, len(trajs),
                                                turn_rewards.shape[1])
  if s.needs_branches and branch_values is None:
    raise ValueError(f"credit scheme {name!r} needs branch_values (branch_returns)")
  inputs = CreditInputs(
      trajectories=tuple(trajs),
      rewards=jnp.asarray([t.reward for t in trajs], jnp.float32),
      turn_rewards=turn_rewards, turn_mask=turn_mask,
      group_ids=jnp.asarray(group_ids_of(trajs)),
      terminated=jnp.asarray([t.terminated for t in trajs]),
      truncated=jnp.asarray([t.truncated for t in trajs]),
      gamma=gamma, lam=lam, values=values, bootstrap=bootstrap,
      branch_returns=branch_values if s.needs_branches else None,
      state_keys=tuple(tuple(t.metadata.get("state_keys", ())) for t in trajs))
  out = _paint(s.fn(inputs), batch, len(trajs), turn_rewards.shape[1], name)
  if not whiten:
    return out
  action = (out.loss_mask > 0) & (out.seq_ids >= 0)
  return out.replace(advantages=np.asarray(adv.whiten_token_advantages(
      jnp.asarray(out.advantages), jnp.asarray(action, jnp.float32))))


def _paint(out: Credit, batch: TokenBatch, num_trajs: int, num_turns: int,
           name: str) -> TokenBatch:
  """`batch` with a scheme's advantages (and value targets) on its tokens."""
  if (out.trajectory is None) == (out.turns is None):
    raise ValueError(f"credit scheme {name!r} must return one of Credit.trajectory "
                     "[N] or Credit.turns [N, T]")
  want = (num_trajs,) if out.turns is None else (num_trajs, num_turns)
  got = np.shape(out.trajectory if out.turns is None else out.turns)
  if got != want:
    raise ValueError(f"credit scheme {name!r} returned advantages of shape {got}; "
                     f"expected {want}")
  seq_ids, turn_index = jnp.asarray(batch.seq_ids), jnp.asarray(batch.turn_index)
  if out.turns is None:
    painted = adv.broadcast_trajectory_values(jnp.asarray(out.trajectory), seq_ids,
                                              turn_index)
  else:
    painted = adv.paint_turn_values(jnp.asarray(out.turns), seq_ids, turn_index)
  batch = batch.replace(advantages=np.asarray(painted))
  if out.returns is None:
    return batch
  if np.shape(out.returns) != (num_trajs, num_turns):
    raise ValueError(f"credit scheme {name!r} returned value targets of shape "
                     f"{np.shape(out.returns)}; expected {(num_trajs, num_turns)}")
  on = np.asarray(decision_mask(turn_index)) & (batch.seq_ids >= 0)
  next_turn = np.pad(batch.turn_index[:, 1:], ((0, 0), (0, 1)), constant_values=0)
  token_returns = np.where(on, np.asarray(out.returns)[np.maximum(batch.seq_ids, 0),
                                                       np.maximum(next_turn, 0)], 0.0)
  return batch.replace(returns=token_returns.astype(np.float32))


# -- The built-in schemes, registered as a user's would be. ---------------------


@register("grpo")
def _grpo(x: CreditInputs) -> Credit:
  return Credit(trajectory=adv.grpo_advantages(x.rewards, x.group_ids, scale="std"))


@register("drgrpo")
def _drgrpo(x: CreditInputs) -> Credit:
  return Credit(trajectory=adv.grpo_advantages(x.rewards, x.group_ids, scale="none"))


@register("rloo")
def _rloo(x: CreditInputs) -> Credit:
  return Credit(trajectory=adv.rloo_advantages(x.rewards, x.group_ids))


@register("turn_returns")
def _turn_returns(x: CreditInputs) -> Credit:
  return Credit(turns=adv.discounted_returns(x.turn_rewards, x.turn_mask, x.gamma))


@register("turn_grpo")
def _turn_grpo(x: CreditInputs) -> Credit:
  per_turn = adv.discounted_returns(x.turn_rewards, x.turn_mask, x.gamma)
  return Credit(turns=adv.group_normalize_turns(per_turn, x.turn_mask, x.group_ids))


@register("gae", needs_values=True)
def _gae(x: CreditInputs) -> Credit:
  a, returns = adv.gae_over_turns(x.turn_rewards, x.values * x.turn_mask, x.turn_mask,
                                  x.terminated, x.gamma, x.lam, x.bootstrap)
  return Credit(turns=a, returns=returns)


@register("branching", needs_branches=True)
def _branching(x: CreditInputs) -> Credit:
  returns, mask = x.branch_returns
  return Credit(turns=adv.branching_advantages(
      jnp.asarray(returns), jnp.asarray(mask), x.turn_rewards, x.turn_mask, x.terminated,
      jnp.zeros(len(x.trajectories)), gamma=x.gamma))


def gigpo(x: CreditInputs, *, omega: float = 1.0, scale: str = "std") -> Credit:
  """GiGPO (`advantages.gigpo_advantages`) on the discounted returns-to-go.

  A turn whose environment reported no state key forms no step group: it
  gets the episode-level advantage only (all turns of python_tool, say).
  Another weight is a scheme of its own:
  `credit.register("gigpo_half")(functools.partial(credit.gigpo, omega=0.5))`.
  The step returns are discounted by `rl.gamma` (x.gamma, default 1.0); the
  paper and verl-agent's scripts use 0.95: set `rl.gamma=0.95` for their
  setting (the scheme cannot tell the default from a chosen 1.0, so it
  never overrides it).
  """
  returns = adv.discounted_returns(x.turn_rewards, x.turn_mask, x.gamma)
  steps = anchor_groups(np.asarray(x.group_ids), x.state_keys, x.turn_mask.shape[1])
  return Credit(turns=adv.gigpo_advantages(
      x.rewards, x.group_ids, returns, jnp.asarray(steps), jnp.asarray(x.turn_mask),
      omega=omega, scale=scale))


register("gigpo")(gigpo)
