"""Rebuilds the bundled corpus and tokenizer (agentrl_jax/assets/).

  python experiments/build_bundled_tokenizer.py

The corpus is generated deterministically from templates in the style of the
bundled environments' text (ReAct tool calls over fictional entities,
arithmetic, a text grid world, small Python functions), so the result is the
same on every machine; tests check that the committed tokenizer.json is
exactly what this script produces.
"""

import random

from agentrl_jax import tokenizer as tok_lib

VOCAB_SIZE = 512
SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "tor", "sel", "qua", "dri", "bel",
             "nox", "ith", "mar", "zu", "pe", "lan", "gor", "shi", "ter", "vo")
RELATIONS = ("was born in", "is the capital of", "founded", "wrote", "married",
             "is located in", "discovered", "invented", "leads", "borders")
KINDS = ("city", "river", "author", "company", "mountain", "scientist", "book")
WORDS = ("the", "a", "of", "and", "in", "is", "to", "what", "which", "who",
         "where", "when", "how", "many", "answer", "question", "search", "find",
         "result", "number", "total", "each", "step", "first", "then", "so",
         "left", "right", "up", "down", "goal", "hole", "frozen", "lake")


def _name(rng):
  return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).title()


def _expr(rng, depth=0):
  if depth > 1 or rng.random() < 0.4:
    return str(rng.randint(0, 999))
  return f"{_expr(rng, depth + 1)} {rng.choice('+-*/')} {_expr(rng, depth + 1)}"


def corpus_lines(seed: int = 0, n: int = 3000):
  rng = random.Random(seed)
  for i in range(n):
    kind = i % 5
    if kind == 0:
      a, b = _name(rng), _name(rng)
      rel = rng.choice(RELATIONS)
      yield (f"<think>I need to find who {rel} {b}.</think><search>{b} "
             f"{rng.choice(KINDS)}</search>\n<observation>[1] {a} {rel} {b}. "
             f"[2] {b} is a {rng.choice(KINDS)}.</observation>\n"
             f"<answer>{a}</answer><|im_end|>")
    elif kind == 1:
      e = _expr(rng)
      yield (f"Question: {' '.join(rng.choice(WORDS) for _ in range(8))}?\n"
             f"<calc>{e}</calc>\n<tool_response>\n{rng.randint(-9999, 9999)}\n"
             f"</tool_response><answer>{rng.randint(0, 999)}</answer>")
    elif kind == 2:
      grid = "\n".join("".join(rng.choice("FFFH") for _ in range(4)) for _ in range(4))
      yield (f"<|im_start|>user\nYou are at row {rng.randint(0, 3)}, column "
             f"{rng.randint(0, 3)}.\n{grid}\nMove {rng.choice(WORDS[-8:-4])}."
             f"<|im_end|>\n<|im_start|>assistant\n{rng.choice(WORDS[-8:-4])}<|im_end|>")
    elif kind == 3:
      f, x = rng.choice(("solve", "count", "total", "f")), rng.choice("xyn")
      yield (f"<python>\ndef {f}({x}):\n    return sum(i * {rng.randint(1, 9)} "
             f"for i in range({x}))\nprint({f}({rng.randint(1, 99)}))\n</python>\n"
             f"<observation>{rng.randint(0, 99999)}</observation>")
    else:
      yield " ".join(rng.choice(WORDS + (_name(rng),)) for _ in range(12)) + "."


def main():
  text = "\n".join(corpus_lines()) + "\n"
  tok_lib.BUNDLED_CORPUS.write_text(text)
  tok = tok_lib.train_bpe_tokenizer(text.splitlines(), VOCAB_SIZE)
  tok.save(str(tok_lib.BUNDLED_TOKENIZER))
  print(f"wrote {tok_lib.BUNDLED_CORPUS} ({len(text)} chars) and "
        f"{tok_lib.BUNDLED_TOKENIZER} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
  main()
