"""Shared test helpers."""

import pytest

from agentrl_jax import tokenizer as T
from agentrl_jax.envs import EPISODE_OVER


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """Processes that tests start (train_agent runs, the notebook's kernel)
  share one persistent JAX compilation cache, so a tiny program they have in
  common compiles once per session. This process imported JAX before, so it
  does not use it; nor do the multi-host workers, which run side by side and
  get an environment built at import (test_multihost.ENV)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    mp.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    yield


def seam_split(tok) -> tuple[str, str]:
  """(" " + head, tail) of a word that BPE merges across the split.

  Encoding head and tail separately gives other ids than encoding the word:
  the situation at a segment seam that re-tokenization would get wrong.
  """
  for token in sorted(tok.get_vocab()):
    word = tok.convert_tokens_to_string([token]).strip()
    if len(word) >= 5 and word.isalpha():
      head, tail = " " + word[:len(word) // 2], word[len(word) // 2:]
      if T.encode(tok, head) + T.encode(tok, tail) != T.encode(tok, head + tail):
        return head, tail
  raise AssertionError("no merging seam in this vocabulary")


def assert_stays_over(env, actions):
  """Steps after the end: the fixed observation, reward 0, still terminated."""
  for action in actions:
    after = env.step(action)
    assert (after.observation, after.reward, after.terminated, after.truncated) == (
        EPISODE_OVER, 0.0, True, False)
    assert after.info["after_end"] and set(after.info["reward_parts"].values()) == {0.0}
