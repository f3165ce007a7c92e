"""Stop strings on the text tokens spell: the automaton, its NumPy scan, the
jitted decode, with the bundled vocabulary and the real Qwen2.5 one."""

from flax import nnx
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import models
from agentrl_jax import tokenizer as T
from agentrl_jax.envs import StepResult, Task
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.sampling import STOP_BUDGET, STOP_SEQUENCE, Sampler, stops

# The spellings of the issue: what Qwen2.5 makes of each text.
QWEN_SPELLINGS = {
    "</search>": ["</", "search", ">"],
    "</search>\n": ["</", "search", ">Ċ"],
    ".</answer>": [".</", "answer", ">"],
    "</python>\n\n": ["</", "python", ">ĊĊ"],
}
TAGS = ["</search>", "</answer>", "</python>", "</submit>", "</move>", "</calc>"]


def test_the_qwen_vocabulary_by_hand(qwen_tokenizer):
  tok = qwen_tokenizer
  assert len(tok) == 151665 and tok.eos_token_id == 151645
  assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<tool_call>",
                                    "<|file_sep|>"]) == [151643, 151644, 151657, 151664]
  # The tool-call tags are added but not special: a decode keeps them.
  assert tok.decode([151657, 151658], skip_special_tokens=True) == "<tool_call></tool_call>"
  assert tok.decode([151644, 151645], skip_special_tokens=True) == ""
  for text, pieces in QWEN_SPELLINGS.items():
    ids = T.encode(tok, text)
    assert tok.convert_ids_to_tokens(ids) == pieces and tok.decode(ids) == text
  assert T.encode(tok, "</search>") == [522, 1836, 29]
  assert T.encode(tok, "<|im_start|>assistant\n") == [151644, 77091, 198]
  assert stops.token_bytes(tok)[397] == b">\n"
  # "é" is two bytes; Qwen has tokens holding one of them, not valid UTF-8 alone.
  halves = [b for b in stops.token_bytes(tok)[:151643] if len(b) == 1 and b[0] >= 0x80]
  assert len(halves) > 60


def _first_stop(token_bytes, ids, strings, stop_ids=()):
  """The reference: the first token after which the text holds a stop."""
  text = b""
  for k, t in enumerate(ids):
    text += token_bytes[t] or b"\0"  # a special token spells no stop
    if t in stop_ids or any(s.encode() in text for s in strings):
      return k
  return -1


@pytest.mark.parametrize("text", list(QWEN_SPELLINGS))
def test_every_qwen_spelling_stops_at_its_last_token(qwen_tokenizer, text):
  matcher = T.CHATML.stop_matcher(qwen_tokenizer, extra=TAGS)
  ids = T.encode(qwen_tokenizer, "I will look it up " + text + " and more")
  at, tag = matcher.scan(ids), text.strip(".\n")
  # The token that completes the tag ends the action (`>\n` whole).
  assert tag in qwen_tokenizer.decode(ids[:at + 1]) and tag not in qwen_tokenizer.decode(ids[:at])
  assert at == _first_stop(_token_bytes(qwen_tokenizer), ids, TAGS)
  # The EOS (<|im_end|>) stops on its own: a special token, no text.
  assert matcher.scan(T.encode(qwen_tokenizer, "ok") + [151645]) == 1


_PIECES = ["</", "search", ">", ">\n", "</search>", "</answer>", ".", "\n", " ", "é", "日本",
           "</sub", "mit>", "answer", "<|im_end|>", "x", "Final", " answer:"]


_STRINGS = TAGS + ["Final answer:", "\n\n", "é"]


@pytest.mark.parametrize("vocab", ["bundled", "qwen"])
@hypothesis.settings(max_examples=100, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(pieces=st.lists(st.sampled_from(_PIECES), max_size=12),
                  strings=st.lists(st.sampled_from(_STRINGS), min_size=1, max_size=4,
                                   unique=True))
def test_scan_and_the_jitted_step_agree_with_find(vocab, qwen_tokenizer, pieces, strings):
  tok = qwen_tokenizer if vocab == "qwen" else T.load_tokenizer()
  if vocab == "qwen":
    strings = _STRINGS  # one matcher (2-3 s to build over 151,665 ids), random texts
  ids = T.encode(tok, "".join(pieces))
  token_bytes = _token_bytes(tok)
  stop_ids = (tok.eos_token_id,)
  matcher = _matcher(token_bytes, tuple(strings), stop_ids)
  at = matcher.scan(ids)
  assert at == _first_stop(token_bytes, ids, strings, stop_ids)
  # The decode loop's step, on the same tables padded as the sampler pads them.
  tables = matcher.tables(128, 256, len(token_bytes))
  state, hits = jnp.zeros(1, jnp.int32), []
  for t in ids:
    state, hit = _advance(tables, state, jnp.asarray([t]))
    hits.append(bool(hit[0]))
  assert (hits.index(True) if True in hits else -1) == at


_advance = jax.jit(stops.advance)
_BYTES, _MATCHERS = {}, {}


def _token_bytes(tok):
  if id(tok) not in _BYTES:
    _BYTES[id(tok)] = stops.token_bytes(tok)
  return _BYTES[id(tok)]


def _matcher(token_bytes, strings, stop_ids):
  key = (id(token_bytes), strings)
  if key not in _MATCHERS:
    _MATCHERS[key] = stops.StopMatcher(token_bytes, [s.encode() for s in strings], stop_ids)
  return _MATCHERS[key]


def test_token_id_stops():
  # Stops as id sequences: the ids are the symbols (5 6 then 6 7, overlapping).
  matcher = stops.StopMatcher.from_token_sequences([(5, 6), (6, 7, 8)], 10)
  assert [matcher.scan(s) for s in ([1, 5, 6], [6, 7, 8], [6, 7, 1, 8], [5, 5, 6])] == [
      2, 2, -1, 2]


def _bigram_model(vocab_size, chain):
  """A 1-layer Qwen2 whose greedy decode follows `chain`: token chain[i] is
  followed by chain[i + 1] (the layer adds nothing; embeddings are one-hot)."""
  cfg = models.tiny_config("qwen2", vocab_size=vocab_size, num_layers=1)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  embed = np.zeros((vocab_size, cfg.hidden_size), np.float32)
  head = np.zeros((cfg.hidden_size, vocab_size), np.float32)
  for i, (a, b) in enumerate(zip(chain, chain[1:])):
    embed[a, i] = 1.0
    head[i, b] = 10.0
  model.embed_tokens.embedding.value = jnp.asarray(embed)
  model.lm_head.kernel.value = jnp.asarray(head)
  layer = model.layers[0]
  layer.self_attn.o_proj.kernel.value = jnp.zeros_like(layer.self_attn.o_proj.kernel.value)
  layer.mlp.down_proj.kernel.value = jnp.zeros_like(layer.mlp.down_proj.kernel.value)
  return model


def test_a_jitted_decode_stops_on_every_qwen_spelling(qwen_tokenizer):
  """The model writes "Let me search</search>\\n..." in Qwen's own tokens:
  `>\\n` (one token) ends the stop, so the action ends there, whole."""
  tok = qwen_tokenizer
  matcher = T.CHATML.stop_matcher(tok, extra=TAGS, vocab_size=151665)
  sampler = None
  for text in QWEN_SPELLINGS:
    prompt = T.encode(tok, "<|im_start|>assistant\n")
    spelled = T.encode(tok, "Let me" + text + "then go on for a while")
    chain = [prompt[-1]] + spelled
    assert len(set(chain)) == len(chain), "a bigram chain needs distinct tokens"
    model = _bigram_model(151665, chain)
    if sampler is None:
      sampler = Sampler(model, num_slots=1, cache_length=64, max_decode_length=24,
                        length_buckets=(8,))
    sampler.update_params(model)
    state = sampler.prefill(sampler.init_state(), [0], [prompt])
    _, free = sampler.decode(state, [0], max_new_tokens=len(spelled), temperature=0.0)
    assert free[0].tokens == spelled  # the planted text, when nothing stops it
    state = sampler.prefill(sampler.init_state(), [0], [prompt])
    _, got = sampler.decode(state, [0], stops=matcher, max_new_tokens=len(spelled),
                            temperature=0.0)
    end = matcher.scan(spelled)
    assert got[0].tokens == spelled[:end + 1] and got[0].stop_reason == STOP_SEQUENCE
    assert tok.decode(got[0].tokens).rstrip("\n").endswith(text.strip(".\n"))
  assert free[0].stop_reason == STOP_BUDGET


class _SearchOnce:
  """Ends after one action, which it records; stops at </search>."""

  system_prompt, stop_strings, actions = "Search.", ("</search>",), []

  def reset(self, task):
    return "Where is it?", {}

  def step(self, action):
    self.actions.append(action)
    return StepResult("found", 1.0, True, False, {})

  def close(self):
    pass


def test_a_rollout_stops_at_a_closing_tag_spelled_with_a_newline(qwen_tokenizer):
  tok = qwen_tokenizer
  prompt = T.CHATML.prompt_ids(tok, "Search.", "Where is it?")
  spelled = T.encode(tok, "Let me search</search>\nthen go on for a while")
  assert 397 in spelled  # `>\n`: the canonical `</ search >` never appears
  sampler = Sampler(_bigram_model(151665, [prompt[-1]] + spelled), num_slots=1,
                    cache_length=64, max_decode_length=16, length_buckets=(32,))
  engine = RolloutEngine(_SearchOnce, tok, T.CHATML, sampler,
                         RolloutConfig(max_turns=1, max_action_tokens=16, temperature=0.0))
  (t,) = engine.run([Task("t", "Where is it?")]).trajectories
  assert list(t.segments[1].token_ids) == spelled[:spelled.index(397) + 1]
  assert t.metadata["stop_reasons"] == [STOP_SEQUENCE] and t.terminated
  assert _SearchOnce.actions == ["Let me search</search>\n"]
  engine.close()
