"""Shared test helpers."""

from agentrl_jax import tokenizer as T


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
