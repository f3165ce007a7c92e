"""The environment contract (envs.contract), user environments by import path,
and a ToolEnv through the rollout engine in Qwen2.5's format."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from agentrl_jax import envs, tools
from agentrl_jax import tokenizer as T
from agentrl_jax.rollout import RolloutConfig, RolloutEngine
from agentrl_jax.trajectory import Role

ROOT = pathlib.Path(__file__).resolve().parents[1]
QWEN_TEMPLATE = (ROOT / "tests/data/qwen2_5_chat_template.jinja").read_text()


class _Bare:
  """reset/step/close and nothing else."""
  def reset(self, task):
    return task.prompt, {}

  def step(self, action):
    return envs.StepResult("", 1.0, True, False, {"success": True})

  def close(self):
    pass


def test_a_missing_piece_fails_at_once_saying_what_to_add():
  with pytest.raises(envs.ContractError) as e:
    envs.check(_Bare(), need_tasks=True, need_expert=True)
  message = str(e.value)
  for piece in ('system_prompt = "..."', "stop_strings = (...)",
                "a method tasks(split, n, seed", "a method expert(task)",
                "--config.sft.steps=0"):
    assert piece in message, piece
  assert message.startswith("environment _Bare needs: ")

  class Complete(_Bare):
    system_prompt, stop_strings = "Hi.", ("</x>",)

  spec = envs.check(Complete())
  assert (spec.system_prompt, spec.stop_strings, spec.tools, spec.has_tasks,
          spec.has_expert) == ("Hi.", ("</x>",), (), False, False)

  class BadStops(Complete):
    stop_strings = "</x>"  # a str, not a tuple of strs
  with pytest.raises(envs.ContractError, match="stop_strings"):
    envs.check(BadStops())


def test_the_engine_checks_the_contract_when_it_is_built():
  tok = T.load_tokenizer()
  with pytest.raises(envs.ContractError, match="stop_strings"):
    RolloutEngine(_Bare, tok, T.CHATML)
  tool_env = lambda: envs.ToolEnv(tools=[_add], reward_fn=lambda t, a: 0.0)
  with pytest.raises(ValueError, match="'chatml' does not render tool schemas"):
    RolloutEngine(tool_env, tok, T.CHATML)
  engine = RolloutEngine(tool_env, tok, T.get_format("qwen2.5"))
  assert engine.tools == (tools.tool(_add).schema,) and engine.stop_strings == ()
  engine.close()


def _add(a: int, b: int) -> int:
  """Adds two numbers.

  Args:
    a: The first.
    b: The second.
  """
  return a + b


def _tasks():
  return [envs.Task("t0", "What is 2 + 3, and 4 + 5?", {"answer": "5 and 9"}),
          envs.Task("t1", "What is 1 + 1?", {"answer": "2"})]


def _expert(task):
  turns = iter({"t0": [tools.render_call("_add", {"a": 2, "b": 3}) + "\n"
                       + tools.render_call("_add", {"a": 4, "b": 5}), "5 and 9"],
                "t1": [tools.render_call("_add", {"a": 1, "b": 1}), "2"]}[task.task_id])
  return lambda observation: next(turns)


def test_a_tool_env_rollout_is_the_templates_token_ids(qwen_tokenizer):
  """Expert episodes through the engine: each trajectory's ids are exactly what
  Qwen2.5's template tokenizes the same conversation to, the loss only on the
  model's turns (calls and answer, each closed with <|im_end|>)."""
  make = lambda: envs.ToolEnv(tools=[_add], reward_fn=lambda t, a: float(a == t.data["answer"]),
                              expert=_expert, system_prompt="Use the tools.")
  engine = RolloutEngine(make, qwen_tokenizer, T.get_format("qwen2.5"),
                         config=RolloutConfig(max_turns=4))
  trajs = engine.run(_tasks(), 1, expert=True).trajectories
  engine.close()
  schema = tools.tool(_add).schema
  prompts = {t.task_id: t.prompt for t in _tasks()}
  for traj, calls, results, answer in zip(
      trajs, ([(2, 3), (4, 5)], [(1, 1)]), (["5", "9"], ["2"]), ("5 and 9", "2")):
    assert traj.metadata["success"] and traj.reward == 1.0 and traj.terminated
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": prompts[traj.metadata["task_id"]]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "_add",
                                                      "arguments": {"a": a, "b": b}}}
                    for a, b in calls]},
                *[{"role": "tool", "content": r} for r in results],
                {"role": "assistant", "content": answer}]
    reference = qwen_tokenizer.apply_chat_template(
        messages, tools=[schema], chat_template=QWEN_TEMPLATE, tokenize=True,
        return_dict=True)["input_ids"]
    flat = [t for s in traj.segments for t in s.token_ids]
    assert flat + T.encode(qwen_tokenizer, "\n") == list(reference)
    actions = [qwen_tokenizer.decode(s.token_ids) for s in traj.segments
               if s.role == Role.ASSISTANT]
    assert actions[-1] == answer + "<|im_end|>" and all(
        a.endswith("</tool_call><|im_end|>") for a in actions[:-1])
    assert traj.metadata["tool_calls"] == 1 and len(set(traj.metadata["state_keys"])) == 2


def test_a_user_environment_by_import_path(tmp_path, monkeypatch):
  (tmp_path / "my_task_env.py").write_text(textwrap.dedent('''
      from agentrl_jax import envs

      def double(x: int) -> int:
        """Doubles.

        Args:
          x: A number.
        """
        return 2 * x

      def make_env(**kwargs):
        return envs.ToolEnv(tools=[double], reward_fn=lambda t, a: 1.0, **kwargs)
  '''))
  monkeypatch.chdir(tmp_path)  # importable from the working directory
  monkeypatch.syspath_prepend(str(tmp_path))
  make = envs.env_class("my_task_env:make_env")
  assert make(call_cost=0.5).call_cost == 0.5
  by_file = envs.env_class(f"{tmp_path}/my_task_env.py:make_env")
  assert by_file().tools == make().tools
  for name, message in (("no_such_module:make_env", "cannot import no_such_module"),
                        ("my_task_env:missing", "has no 'missing'"),
                        (f"{tmp_path}/nope.py:make_env", "no file"),
                        ("chess", "unknown environment 'chess'")):
    with pytest.raises(ValueError, match=message):
      envs.env_class(name)


TINY = ["--config.sft.steps=3", "--config.sft.num_demos=8", "--config.sft.batch_size=4",
        "--config.env.num_train_tasks=16", "--config.env.num_eval_tasks=4",
        "--config.rl.tasks_per_iteration=2", "--config.rl.group_size=2",
        "--config.sampler.num_slots=4", "--config.iterations=1", "--config.eval_samples=1"]


def test_the_tool_example_runs_with_its_env_named_by_module(tmp_path):
  """experiments/configs/tools_example.py at a tiny size, its environment named
  as `module:attr` from outside the package (the module is importable from
  the working directory)."""
  out = subprocess.run(
      [sys.executable, str(ROOT / "experiments/train_agent.py"),
       f"--config={ROOT}/experiments/configs/tools_example.py",
       "--config.env.name=warehouse_tools:make_env", f"--workdir={tmp_path / 'run'}", *TINY],
      cwd=ROOT / "experiments/configs", capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "held-out success after SFT" in out.stdout and "after RL" in out.stdout
  assert (tmp_path / "run" / "summary.json").exists()


def test_a_contract_error_stops_a_run_before_any_work(tmp_path):
  (tmp_path / "bare_env.py").write_text(textwrap.dedent('''
      class BareEnv:
        system_prompt = "x"
        def reset(self, task): return task.prompt, {}
        def step(self, action): raise NotImplementedError
        def close(self): pass
  '''))
  out = subprocess.run(
      [sys.executable, str(ROOT / "experiments/train_agent.py"),
       # plain FrozenLake's config: the default's env.kwargs are FrozenLake's.
       f"--config={ROOT}/experiments/configs/default.py:plain", "--config.env.name=bare_env:BareEnv",
       f"--workdir={tmp_path / 'run'}"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "environment BareEnv needs: stop_strings = (...)" in out.stderr, out.stderr[-2000:]
  assert "a method tasks(split, n, seed" in out.stderr
