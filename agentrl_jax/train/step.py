"""The jitted RL and SFT train steps.

`RLStep(graphdef, tx, cfg)` is `train_step(state, batch) -> (state,
metrics)`, jitted with the state donated (under a `mesh`: see `_StepJit`):

  1. reference log-probs for the KL term: a program of its own, run before
     the step (no grad), so the step's temporaries never hold the
     reference forward's (on XLA:CPU, a float32 copy of the bf16 reference
     that the micro-batch loop hoists; what that saves:
     benchmarks/step_memory.py);
  2. for each of `ppo_epochs`: accumulate gradients over `micro_batches`
     (lax.scan), then one optax update, skipped if the loss or any gradient
     is non-finite. The first epoch's forward runs before any update, so
     its log-probs are also the trainer's behaviour log-probs: carried to
     later epochs, used by "tis", and compared with the sampler's
     (`behaviour_forward`: the gap and entropy metrics). The metrics are
     the first epoch's; with several, the ratio ones (`approx_kl`, clip
     fractions, `ratio_*`) of the last epoch come too, as
     `<name>_last_epoch`: how far the later epochs moved the policy.

Gradient accumulation is exact: the aggregation weights of every token
(`losses.aggregation_weights`: 1 / action tokens for "token-mean", 1 /
(sequences x the sequence's action tokens) for "seq-mean-token-mean", ...)
are computed on the whole batch before it is split, so summing the
micro-batches' weighted losses gives the full-batch loss and gradient
whatever the split, also when the views of one sliding-window trajectory
land in different micro-batches. Token-mean metrics (clip fractions,
ratios) combine by each micro-batch's share of the action tokens.

The LM head runs only where a loss is: the hidden states that predict
action tokens are gathered into a static [B, A] bucket (A the most action
tokens of a row, rounded up to a power of two: `losses.action_bucket`)
before the head, and the head's float32 logits exist `head_chunk` positions
at a time, also in the backward pass (`losses.head_logprobs`). No [B, L, V]
array is formed; agentic batches are mostly observation tokens. The value
head reads the same gathered states: the state before a turn's first
action token is that turn's decision state, where V(s_t) trains.

A step runs one forward with grad per PPO epoch, plus one of the
reference without grad (its own program) when `kl_beta > 0`. `behaviour_forward` adds no
forward, only the entropy over the vocabulary at each action position for
its metrics; turned off, nothing compares the sampler with the trainer.

Importance ratios use the sampler's rollout log-probs of the trained
policy (`is_correction="none"`: valid only when the rollouts sample that
policy itself, which `rl.check_sections` enforces), or, with "tis", the
decoupled objective (AReaL's decoupled PPO, Fu et al. 2025): ratios
against the trainer's own recomputed log-probs (the proximal policy),
times truncated importance weights min(pi_trainer / mu, tis_cap), mu the
distribution each token was drawn from (`TokenBatch.sampling_logprobs`:
the rollout's temperature, top-k and top-p, and in asynchronous RL its
older weights; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training").
"""

from __future__ import annotations

import dataclasses

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentrl_jax import host_memory, losses, sharding
from agentrl_jax.checks import check_fields
from agentrl_jax.masked import masked_mean
from agentrl_jax.models import decoder
from agentrl_jax.train.state import TrainState, model_params
from agentrl_jax.trajectory import TokenBatch

IS_CORRECTIONS = ("none", "tis")
# The policy-loss metrics that depend on the ratio to the behaviour policy.
_RATIO_METRICS = ("approx_kl", "clip_frac_upper", "clip_frac_lower", "dual_clip_frac",
                  "ratio_mean", "ratio_max")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  clip_low: float = 0.2
  clip_high: float = 0.28
  dual_clip: float | None = None
  agg: str = "token-mean"
  norm_constant: float | None = None  # for "seq-mean-token-sum-norm"
  kl_beta: float = 0.0  # 0: no reference forward at all
  # `losses.kl_penalty`: k3's gradient follows KL(ref || pi), k2's, k1+'s and
  # k3+'s KL(pi || ref); logged as `losses.kl_metric_name(kl_kind)`.
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  value_coef: float = 0.0  # needs a value head and batch.returns
  # True: the value loss trains the value head alone, on the policy's hidden
  # states with their gradient stopped, so a freshly initialised head cannot
  # move the policy's trunk (a critic on the policy's features, like a
  # separate critic model leaves the actor alone). False shares the trunk.
  value_detach: bool = False
  # "none": ratios against the sampler's log-probs of the trained policy
  # (rollouts must sample that policy itself); "tis": the decoupled
  # objective, weights min(pi_trainer / mu, tis_cap) with mu the
  # distribution the tokens were drawn from (see the module doc).
  is_correction: str = "none"
  tis_cap: float = 2.0
  ppo_epochs: int = 1
  micro_batches: int = 1
  # The sampler-vs-trainer gap and entropy metrics, from the first epoch's
  # forward ("tis" reads that forward's log-probs either way).
  behaviour_forward: bool = True
  head_chunk: int = 1024  # positions whose [., V] logits exist at once
  # The policy the loss trains is softmax(logits / temperature), in the
  # policy and reference forwards and the entropy. Set to the rollouts'
  # sampling temperature (with the sampler's `policy_temperature` equal),
  # the update is that of the distribution the rollouts were drawn from, as
  # veRL and TRL do; another temperature trains a policy the rollouts did
  # not sample, which needs is_correction="tis" (`rl.check_sections`).
  temperature: float = 1.0

  def __post_init__(self):
    check_fields(self, [
        ("agg", self.agg in losses.LOSS_AGG_MODES,
         f"must be one of {losses.LOSS_AGG_MODES}"),
        ("kl_kind", self.kl_kind in losses.LOSS_KL_KINDS,
         f"must be one of {losses.LOSS_KL_KINDS} (k1's expected gradient is 0: its "
         "straight-through k1+ has k1's value and k2's gradient)"),
        ("is_correction", self.is_correction in IS_CORRECTIONS,
         f"must be one of {IS_CORRECTIONS}"),
        ("head_chunk", self.head_chunk >= 1, "must be >= 1"),
        ("micro_batches", self.micro_batches >= 1, "must be >= 1"),
        ("ppo_epochs", self.ppo_epochs >= 1, "must be >= 1"),
        ("temperature", self.temperature > 0, "must be > 0"),
    ])


def decision_mask(turn_index: jax.Array) -> jax.Array:
  """[B, L] True at the token just before each turn's first action token.

  Its hidden state has read the whole context s_t of turn t: that is where
  the value head's V(s_t) is read and trained.
  """
  nxt = jnp.pad(turn_index[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  return (nxt >= 0) & (nxt != turn_index)


def _hidden(graphdef: nnx.GraphDef, params, batch: TokenBatch):
  """(the model, its final hidden states [B, L, d] on a batch)."""
  model = nnx.merge(graphdef, params)
  hidden, _ = model.hidden_states(batch.tokens, batch.positions, seq_ids=batch.seq_ids,
                                  prefix_ids=batch.prefix_ids)
  return model, hidden


def token_values(graphdef: nnx.GraphDef, params, batch: TokenBatch) -> jax.Array:
  """[B, L] float32 value-head outputs (needs a value head)."""
  model, hidden = _hidden(graphdef, params, batch)
  return model.values(hidden)


def action_heads(graphdef: nnx.GraphDef, params, batch: TokenBatch, index: jax.Array,
                 *, chunk: int, entropy: bool = False, accuracy: bool = False,
                 values: bool = False, value_detach: bool = False,
                 temperature: float = 1.0) -> dict[str, jax.Array]:
  """The head at the positions that predict the tokens at `index` [B, A].

  Returns `losses.head_logprobs`'s [B, A] arrays (of the policy at
  `temperature`), plus "values" [B, A] when
  asked: the value head on the same states (at a turn's first action token,
  the state before it is the turn's decision state), through a stopped
  gradient with `value_detach`.
  """
  model, hidden = _hidden(graphdef, params, batch)
  # The state at i - 1 predicts token i (an action never opens a sequence).
  states = jnp.take_along_axis(hidden, jnp.maximum(index - 1, 0)[..., None], axis=1)
  head = model.logits
  if model.cfg.remat:
    # The head's weights cast per chunk, like the layers' (`decoder.after`):
    # a vocabulary-sized cast lives for a chunk, not for the whole step.
    head = lambda h: nnx.merge(graphdef, decoder.after(params, h)).logits(h)
  out = losses.head_logprobs(head, states,
                             jnp.take_along_axis(batch.tokens, index, axis=1),
                             chunk=chunk, entropy=entropy, accuracy=accuracy,
                             temperature=temperature)
  if values:
    out["values"] = model.values(jax.lax.stop_gradient(states) if value_detach else states)
  return out


def action_logprobs(graphdef: nnx.GraphDef, params, batch: TokenBatch, num_actions: int,
                    *, chunk: int, temperature: float = 1.0) -> jax.Array:
  """[B, L] float32 log-probs of the batch's action tokens under `params`
  at `temperature` (0 elsewhere): the trainer's view of what the sampler
  sampled."""
  index, valid = losses.action_positions(batch.loss_mask * (batch.seq_ids >= 0), num_actions)
  lp = action_heads(graphdef, params, batch, index, chunk=chunk,
                    temperature=temperature)["logprobs"]
  rows = jnp.arange(index.shape[0])[:, None]
  return jnp.zeros(batch.tokens.shape, jnp.float32).at[rows, index].add(
      jnp.where(valid, lp, 0.0))


@flax.struct.dataclass
class _Actions:
  """A batch's per-token arrays at its action tokens, [B, A] each."""

  index: jax.Array  # int32 position in the row (0 past the row's last action)
  mask: jax.Array  # float32, 1 on real action tokens
  old_logprobs: jax.Array
  sampling_logprobs: jax.Array
  advantages: jax.Array
  weights: jax.Array  # aggregation weights, computed on the whole batch
  # 1 on each turn's first action token: the state before it is a decision
  # state (`decision_mask`), where the value head trains on `returns`.
  first: jax.Array
  returns: jax.Array  # the returns at the state before the token


def _dropped_actions(batch: TokenBatch, valid: jax.Array) -> jax.Array:
  """Action tokens past a too-small bucket: the step then skips its update
  (counted in `skipped_updates`) rather than train on part of the batch."""
  return jnp.sum((batch.loss_mask > 0) & (batch.seq_ids >= 0)) - jnp.sum(valid)


def _actions(batch: TokenBatch, weights: jax.Array, num_actions: int) -> _Actions:
  index, valid = losses.action_positions(batch.loss_mask * (batch.seq_ids >= 0),
                                         num_actions)
  before = jnp.maximum(index - 1, 0)
  at = lambda x, i=index: jnp.where(valid, jnp.take_along_axis(x, i, axis=1), 0.0)
  # (An observation token in the loss, `observation_loss`, starts no turn.)
  first = valid & (at(batch.turn_index) >= 0) & (at(batch.turn_index, before)
                                                 != at(batch.turn_index))
  return _Actions(index=index, mask=valid.astype(jnp.float32),
                  old_logprobs=at(batch.old_logprobs),
                  sampling_logprobs=at(batch.sampling_logprobs),
                  advantages=at(batch.advantages),
                  weights=at(weights), first=first.astype(jnp.float32),
                  returns=at(batch.returns, before))


def _all_finite(tree) -> jax.Array:
  """[] bool: whether every element of every leaf is finite.

  The per-leaf flags pass through a sort before their AND. XLA rewrites an
  AND over a stack of scalars into a chain of scalar ANDs, and fusion copies
  that chain into every fusion that reads the result (each parameter's and
  moment's update): leaves^2 instructions, which an XLA:CPU executable
  keeps in host memory (benchmarks/README.md, smoke_run.py). A sort is not
  fused into its consumers, so the chain is computed once.
  """
  flags = jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])
  return jnp.all(jax.lax.sort(flags))


def _keep_if(ok: jax.Array, new, old):
  """`new` where the update is finite (ok), else `old`: a bad step changes nothing."""
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _update(tx: optax.GradientTransformation, grads, opt_state, params, ok: jax.Array):
  """(params, opt_state) after one `tx` step, or unchanged where not `ok`.

  Each parameter is updated before its optimizer state: every state subtree
  shaped like the parameters (AdamW's mu and nu), and the gradients, go
  through `decoder.after` on the matching new parameter (an optimization
  barrier would do, but XLA:CPU drops them). Both updates read the old
  state (XLA recomputes e.g. AdamW's new moments inside the parameters'
  update) and the state's own update overwrites it in place; in no set
  order XLA copies every leaf's moments first, 2 float32 copies a
  parameter at the step's peak (benchmarks/README.md, step_memory.py).
  `tx`'s state update must not read the parameters (AdamW's does not): the
  second call gets the new ones. The values are the same, but XLA fuses
  the arithmetic otherwise, so results move in the last bits.
  """
  updates, _ = tx.update(grads, opt_state, params)
  new_params = _keep_if(ok, optax.apply_updates(params, updates), params)
  shape = jax.tree.structure(new_params)
  like_params = lambda x: jax.tree.structure(x) == shape
  after = lambda x: (jax.tree.map(decoder.after, x, new_params) if like_params(x) else x)
  grads, later = after(grads), jax.tree.map(after, opt_state, is_leaf=like_params)
  _, new_opt = tx.update(grads, later, new_params)  # its updates are unused
  return new_params, _keep_if(ok, new_opt, opt_state)


def _split(batch, n: int):
  """[B, ...] leaves -> [n, B / n, ...] micro-batches."""
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {n} micro-batches")
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])
  return jax.tree.map(split, batch)


def _action_bucket(batch: TokenBatch, num_actions: int | None) -> int:
  """`num_actions`, or else from a host batch (`losses.action_bucket`); a
  placed one is not read back (no transfer in the hot path): every
  position."""
  if num_actions is not None:
    return num_actions
  length = batch.loss_mask.shape[-1]
  return (losses.action_bucket(losses.most_actions(batch.loss_mask), length)
          if isinstance(batch.loss_mask, np.ndarray) else length)


class _StepJit:
  """`step(state, batch, num_actions) -> (state, metrics)` jitted with the
  state donated and `num_actions` (the action bucket, from the host) static;
  with `reads_state`, `step(state, batch, num_actions) -> outputs` that
  leaves the state as it is (not donated).

  Compiled ahead of the call, once per input signature (what jax.jit
  caches on), so the compiler's freed host memory goes back to the OS
  before the step allocates its temporaries (`host_memory.release_freed`).

  Under a mesh the shardings are fixed at the jit boundary: the state by the
  partition rules, the same in and out (so donation reuses its buffers and
  the next call finds the layout it was compiled for), batch rows over
  ("data", "fsdp"), metrics (and a reading program's outputs) replicated. The state's shardings follow its
  tree, so that jit is built at the first call.
  """

  def __init__(self, step, mesh: jax.sharding.Mesh | None, *, reads_state: bool = False):
    self._step, self._mesh, self._reads_state = step, mesh, reads_state
    self._donate = () if reads_state else (0,)
    self._jit = (jax.jit(step, donate_argnums=self._donate, static_argnums=(2,))
                 if mesh is None else None)
    self._shardings = None
    self._compiled = {}

  def _jitted(self, state: TrainState):
    if self._jit is None:
      state_sharding = sharding.param_shardings(state, self._mesh)
      self._shardings = (state_sharding, sharding.batch_sharding(self._mesh))
      out = sharding.replicated(self._mesh)
      self._jit = jax.jit(self._step, donate_argnums=self._donate, static_argnums=(2,),
                          in_shardings=self._shardings,
                          out_shardings=out if self._reads_state else (state_sharding, out))
    return self._jit

  def lower(self, state: TrainState, batch, num_actions: int) -> jax.stages.Lowered:
    """The program for these inputs, lowered (abstract ones allocate nothing)."""
    return self._jitted(state).lower(state, batch, num_actions)

  def __call__(self, state: TrainState, batch, num_actions: int):
    if self._mesh is not None:
      self._jitted(state)
      # Commit both (a no-op once placed): a host batch goes straight to its
      # row shards.
      state, batch = sharding.shard((state, batch), self._shardings)
    leaves, tree = jax.tree.flatten((state, batch))
    key = (num_actions, tree, tuple(map(jax.typeof, leaves)))
    if key not in self._compiled:
      self._compiled[key] = self.lower(state, batch, num_actions).compile()
      host_memory.release_freed()
    return self._compiled[key](state, batch)


class RLStep:
  """Jitted `(state, batch) -> (state, metrics)`; see the module doc.

  mesh: None (one device, or wherever the inputs already are), or a
    `sharding.make_mesh` mesh to run data/FSDP/tensor parallel on.
  """

  def __init__(self, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
               cfg: LossConfig, *, mesh: jax.sharding.Mesh | None = None):
    self.graphdef, self.tx, self.cfg, self.mesh = graphdef, tx, cfg, mesh
    self.traces = 0
    self._jit = _StepJit(self._step, mesh)
    self._reference_jit = _StepJit(self._reference, mesh, reads_state=True)

  def __call__(self, state: TrainState, batch: TokenBatch, num_actions: int | None = None):
    """One step. `num_actions`: the action bucket A (`losses.action_bucket`
    of the host batch; what every process agreed on in a multi-host run);
    None: from `batch` when it is on the host, else every position."""
    num_actions = _action_bucket(batch, num_actions)
    ref = (self._reference_jit(state, batch, num_actions) if self.cfg.kl_beta > 0
           else None)
    return self._jit(state, (batch, ref), num_actions)

  def lower(self, state: TrainState, batch: TokenBatch,
            num_actions: int) -> dict[str, jax.stages.Lowered]:
    """The programs a call runs, lowered for these inputs (abstract ones,
    e.g. from `jax.eval_shape`, allocate nothing): "reference" (with a KL
    term) and "step", run one after the other; `.compile().memory_analysis()`
    sizes each."""
    out, ref = {}, None
    if self.cfg.kl_beta > 0:
      out["reference"] = self._reference_jit.lower(state, batch, num_actions)
      ref = jax.eval_shape(lambda s, b: self._reference(s, b, num_actions), state, batch)
    out["step"] = self._jit.lower(state, (batch, ref), num_actions)
    return out

  def _reference(self, state: TrainState, batch: TokenBatch, num_actions: int) -> jax.Array:
    """[B, A] float32 log-probs of the action tokens under the KL reference,
    in `_actions`' layout, one micro-batch at a time (no grad)."""
    index, _ = losses.action_positions(batch.loss_mask * (batch.seq_ids >= 0), num_actions)
    micro = _split((batch, index), self.cfg.micro_batches)
    ref_params = model_params(state.frozen, state.ref_params)  # LoRA: the base + its start
    ref = jax.lax.map(lambda xs: action_heads(self.graphdef, ref_params, *xs,
                                              chunk=self.cfg.head_chunk,
                                              temperature=self.cfg.temperature)["logprobs"],
                      micro)
    return ref.reshape(index.shape)

  def _step(self, state: TrainState, inputs: tuple[TokenBatch, jax.Array | None],
            num_actions: int):
    """inputs: the batch, and the reference's log-probs (`_reference`; None
    without a KL term)."""
    self.traces += 1  # runs only while tracing
    cfg = self.cfg
    batch, ref = inputs
    # Aggregation weights over the whole batch, before the split: exact
    # accumulation whatever micro-batch a token (or a view) lands in.
    weights_all = losses.aggregation_weights(
        batch.loss_mask, cfg.agg, norm_constant=cfg.norm_constant, seq_ids=batch.seq_ids)
    all_acts = _actions(batch, weights_all, num_actions)
    dropped = _dropped_actions(batch, all_acts.mask > 0)
    if ref is None:
      ref = jnp.zeros_like(all_acts.old_logprobs)
    micro, acts, ref = _split((batch, all_acts, ref), cfg.micro_batches)
    rollout, mask = acts.old_logprobs, acts.mask
    tokens = jnp.sum(mask, axis=(1, 2))
    token_share = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    decisions = jnp.sum(acts.first, axis=(1, 2))
    value_share = decisions / jnp.maximum(jnp.sum(decisions), 1.0)
    tis = cfg.is_correction == "tis"

    def loss_fn(params, mb, act, ref, token_share, value_share, behaviour, first):
      # Gradients for the trained parameters only (all, or LoRA's).
      out = action_heads(self.graphdef, model_params(state.frozen, params), mb, act.index,
                         chunk=cfg.head_chunk,
                         entropy=cfg.entropy_coef > 0 or cfg.behaviour_forward,
                         values=cfg.value_coef > 0, value_detach=cfg.value_detach,
                         temperature=cfg.temperature)
      lp = out["logprobs"]
      # The behaviour log-probs are the first epoch's own forward: no update
      # has happened yet, so it computes what a separate forward would.
      behaviour = jnp.where(first, jax.lax.stop_gradient(lp), behaviour)
      if tis:
        old = behaviour
        weights = jnp.minimum(jnp.exp(jnp.where(act.mask > 0,
                                                behaviour - act.sampling_logprobs, 0.0)),
                              cfg.tis_cap)
      else:
        old, weights = act.old_logprobs, jnp.ones_like(lp)
      pg, m = losses.policy_loss(
          lp, old, act.advantages, act.mask, clip_low=cfg.clip_low,
          clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, is_weights=weights,
          token_weights=act.weights)
      # Token-mean metrics combine by token share, maxima by max; the loss
      # terms are already this micro-batch's part of the full-batch sum.
      if tis:  # how far the drawn distribution was from the trained policy
        m["tis_weight_mean"] = masked_mean(weights, act.mask)
        m["tis_capped_frac"] = masked_mean((weights >= cfg.tis_cap).astype(jnp.float32),
                                           act.mask)
      m = {k: v if k.endswith("_max") else token_share * v for k, v in m.items()}
      loss = m["pg_loss"] = pg
      if cfg.kl_beta > 0:
        kl = m[losses.kl_metric_name(cfg.kl_kind)] = losses.weighted_sum(
            losses.kl_penalty(lp, ref, cfg.kl_kind), act.weights)
        loss = loss + cfg.kl_beta * kl
      if cfg.entropy_coef > 0:
        m["entropy"] = losses.weighted_sum(out["entropy"], act.weights)
        loss = loss - cfg.entropy_coef * m["entropy"]
      if cfg.value_coef > 0:
        m["value_loss"] = value_share * masked_mean(
            jnp.square(out["values"] - act.returns), act.first)
        loss = loss + cfg.value_coef * m["value_loss"]
      entropy = (jax.lax.stop_gradient(out["entropy"]) if cfg.behaviour_forward
                 else jnp.zeros_like(lp))
      return loss, (m, behaviour, entropy)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    # -- PPO epochs of exact gradient accumulation. -------------------------------
    def epoch(carry, first):
      params, opt_state, step, skipped, behaviour = carry
      xs_all = (micro, acts, ref, token_share, value_share, behaviour)

      def micro_step(acc, xs):
        (loss, (m, lp, ent)), g = grad_fn(params, *xs, first)
        acc_loss, acc_m, acc_g = acc
        acc_m = {k: jnp.maximum(acc_m[k], v) if k.endswith("_max") else acc_m[k] + v
                 for k, v in m.items()}
        return (acc_loss + loss, acc_m, jax.tree.map(jnp.add, acc_g, g)), (lp, ent)

      zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
          lambda: grad_fn(params, *jax.tree.map(lambda x: x[0], xs_all), first)))
      zeros = (zeros[0][0], zeros[0][1][0], zeros[1])
      (loss, m, grads), (behaviour, entropy) = jax.lax.scan(micro_step, zeros, xs_all)
      ok = jnp.isfinite(loss) & (dropped == 0) & _all_finite(grads)
      m = {**m, "loss": loss, "grad_norm": optax.tree.norm(grads),
           "skipped_update": 1.0 - ok.astype(jnp.float32)}
      if cfg.behaviour_forward:
        gap = jnp.where(mask > 0, behaviour - rollout, 0.0)
        m.update({
            # The policy's entropy on the sampled states, before the update.
            "policy_entropy": masked_mean(entropy, mask),
            "logprob_gap_mean_abs": masked_mean(jnp.abs(gap), mask),
            "logprob_gap_max_abs": jnp.max(jnp.abs(gap)),
            # k3 estimate of KL(sampler || trainer) from the sampler's tokens.
            "logprob_gap_kl": masked_mean(losses.kl_penalty(rollout, behaviour, "k3"), mask),
        })
      carry = (*_update(self.tx, grads, opt_state, params, ok), step + ok, skipped + (1 - ok),
               behaviour)
      return carry, m

    (params, opt_state, step, skipped, _), per_epoch = jax.lax.scan(
        epoch, (state.params, state.opt_state, state.step, state.skipped,
                jnp.zeros_like(rollout)), jnp.arange(cfg.ppo_epochs) == 0)
    metrics = {k: v[0] for k, v in per_epoch.items()}  # first epoch: on-policy
    # Its ratios are 1 up to the sampler's gap; how far the later epochs
    # moved the policy shows in the last one's.
    if cfg.ppo_epochs > 1:
      metrics.update({f"{k}_last_epoch": per_epoch[k][-1] for k in _RATIO_METRICS})
    metrics["skipped_updates"] = jnp.sum(per_epoch["skipped_update"])
    metrics["dropped_actions"] = dropped
    metrics.pop("skipped_update")
    return state.replace(params=params, opt_state=opt_state, step=step,
                         skipped=skipped), metrics


class SFTStep:
  """Jitted masked cross-entropy on ASSISTANT tokens (expert distillation).

  The loss is the mean over the batch's action tokens; `micro_batches`
  splits the rows and accumulates the gradient exactly (each micro-batch's
  sum over the whole batch's token count), so only one micro-batch's
  activations exist at a time. mesh: as for `RLStep`.
  """

  def __init__(self, graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *,
               mesh: jax.sharding.Mesh | None = None, head_chunk: int = 1024,
               micro_batches: int = 1):
    if micro_batches < 1:
      raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    self.graphdef, self.tx, self.head_chunk = graphdef, tx, head_chunk
    self.micro_batches = micro_batches
    self.traces = 0
    self._jit = _StepJit(self._step, mesh)

  def __call__(self, state: TrainState, batch: TokenBatch, num_actions: int | None = None):
    """One step; `num_actions` as for `RLStep`."""
    return self._jit(state, batch, _action_bucket(batch, num_actions))

  def lower(self, state: TrainState, batch: TokenBatch,
            num_actions: int) -> dict[str, jax.stages.Lowered]:
    """The step's program for these inputs, lowered (as `RLStep.lower`)."""
    return {"step": self._jit.lower(state, batch, num_actions)}

  def _step(self, state: TrainState, batch: TokenBatch, num_actions: int):
    self.traces += 1
    index, valid = losses.action_positions(batch.loss_mask * (batch.seq_ids >= 0),
                                           num_actions)
    dropped = _dropped_actions(batch, valid)
    count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)

    def loss_fn(params, mb, mb_index, mb_valid):
      out = action_heads(self.graphdef, model_params(state.frozen, params), mb, mb_index,
                         chunk=self.head_chunk, accuracy=True)
      return (-jnp.sum(jnp.where(mb_valid, out["logprobs"], 0.0)) / count,
              jnp.sum(jnp.where(mb_valid, out["accuracy"], 0.0)) / count)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro_step(acc, xs):
      (loss, acc_part), g = grad_fn(state.params, *xs)
      return jax.tree.map(jnp.add, acc, (loss, acc_part, g)), None

    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
    (loss, acc, grads), _ = jax.lax.scan(
        micro_step, zeros, _split((batch, index, valid), self.micro_batches))
    ok = jnp.isfinite(loss) & (dropped == 0)
    params, opt_state = _update(self.tx, grads, state.opt_state, state.params, ok)
    state = state.replace(params=params, opt_state=opt_state,
                          step=state.step + ok, skipped=state.skipped + (1 - ok))
    return state, {"sft_loss": loss, "token_accuracy": acc,
                   "grad_norm": optax.tree.norm(grads), "dropped_actions": dropped}
