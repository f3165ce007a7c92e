"""Rebuilds the bundled corpus and tokenizer (agentrl_jax/assets/).

  python experiments/build_bundled_tokenizer.py

The corpus is the bundled environments' own text: their system prompts,
train-split task prompts, and the observations and actions of their scripted
experts (the Python tool's expert code without running it), plus the chat
formats' templates. Everything is deterministic, so the result is the same on
every machine; tests check that the committed tokenizer.json is exactly what
this script produces.
"""

from agentrl_jax import envs
from agentrl_jax import tokenizer as tok_lib

VOCAB_SIZE = 512
EPISODES_PER_ENV = 120


def corpus_lines(episodes: int = EPISODES_PER_ENV):
  # The formats the bundled vocabulary was built with (qwen2.5 renders as
  # chatml without tools).
  for fmt in (tok_lib.CHATML, tok_lib.REACT):
    yield fmt.render("You are an agent.", "Task.", ["<answer>1</answer><|im_end|>"], ["2"])
  for name in ("search_qa", "calculator", "frozen_lake"):
    cls = envs.env_class(name)
    env = cls()
    yield cls.system_prompt
    for task in cls.tasks("train", episodes, seed=0):
      observation, _ = env.reset(task)
      expert = env.expert(task)
      yield observation
      for _ in range(16):
        action = expert(observation)
        result = env.step(action)
        observation = result.observation
        yield action
        yield observation
        if result.terminated or result.truncated:
          break
  python = envs.env_class("python_tool")
  yield python.system_prompt
  for task in python.tasks("train", episodes, seed=0):
    yield task.prompt
    yield python.expert(task)(task.prompt)


def main():
  text = "\n".join(corpus_lines()) + "\n"
  tok_lib.BUNDLED_CORPUS.write_text(text)
  tok = tok_lib.train_bpe_tokenizer(text.splitlines(), VOCAB_SIZE)
  tok.save(str(tok_lib.BUNDLED_TOKENIZER))
  print(f"wrote {tok_lib.BUNDLED_CORPUS} ({len(text)} chars) and "
        f"{tok_lib.BUNDLED_TOKENIZER} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
  main()
