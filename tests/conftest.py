"""Shared test helpers; one persistent JAX compilation cache and one XLA
thread per process for the run."""

import atexit
import os
import shutil
import tempfile

# Tests build equal programs again and again (a fresh Sampler or RLStep per
# test, the train_agent runs and the notebook's kernel they start), so every
# process of the run (xdist workers and the processes tests start inherit
# the variables, set here before any of them exists) shares one persistent
# compilation cache: a hit loads in a fraction of the compile time (a fresh
# RL trainer's first iteration: 11 s -> 1.6 s here).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="agentrl-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# The two workers share two cores: one XLA compute thread each, else each
# worker's thread pool fights the other's (a test's tiny programs run as fast
# on one thread: test_rl_improves_held_out_success_from_sft alone 70 s on
# one, 75 s on two; in the suite 112 s on one, 176 s on two).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_cpu_multi_thread_eigen=false"]).strip()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

# In case a plugin imported JAX before the variables were set.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from agentrl_jax import tokenizer as T  # pylint: disable=wrong-import-position
from agentrl_jax.envs import EPISODE_OVER  # pylint: disable=wrong-import-position


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


@pytest.fixture(scope="session")
def qwen_tokenizer():
  """The real Qwen2/2.5 vocabulary (`tokenizer.qwen2_tokenizer`)."""
  return T.qwen2_tokenizer()


@pytest.fixture(scope="session")
def qwen3_tokenizer():
  """The real Qwen3 vocabulary (`tokenizer.qwen3_tokenizer`)."""
  return T.qwen3_tokenizer()


@pytest.fixture(scope="session")
def gemma_tokenizer():
  """A stand-in for Gemma's vocabulary, whose real 256k SentencePiece pieces
  are not available offline: the bundled corpus's 512-token byte-level BPE
  with Gemma's <pad>, <eos>, <bos> (ids 0-2, as Gemma's) and its turn
  markers, special tokens as in its tokenizer_config.json."""
  import transformers  # pylint: disable=g-import-not-at-top
  turns = ["<start_of_turn>", "<end_of_turn>"]
  backend = T.train_bpe_tokenizer(T.BUNDLED_CORPUS.read_text().splitlines(), 512,
                                  special_tokens=("<pad>", "<eos>", "<bos>", *turns))
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
      additional_special_tokens=turns)


def require_browser() -> None:
  """Skips a test that opens a page in headless Chromium where none is
  installed, naming the package; under `AGENTRL_REQUIRE_BROWSER=1` (what
  .ci/run sets after installing it) a missing browser fails instead, so CI
  never passes by skipping."""
  import view  # pylint: disable=g-import-not-at-top  (experiments/ is on the path)
  try:
    view.chromium()
  except FileNotFoundError:
    message = ("needs headless Chromium, Debian's `chromium` package "
               "(apt-get install chromium; .ci/run installs it)")
    if os.environ.get("AGENTRL_REQUIRE_BROWSER") == "1":
      pytest.fail(message + ", and AGENTRL_REQUIRE_BROWSER=1")
    pytest.skip(message)
