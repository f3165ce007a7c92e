"""The trajectory viewer: records against the batch they were trained from,
the page's tokens against the records, and the page in a real browser."""

import html.parser
import pathlib
import sys

import numpy as np
import pytest

from agentrl_jax import tokenizer as T
from agentrl_jax import viewer
from agentrl_jax.train import credit
from agentrl_jax.trajectory import Role, Segment, Trajectory, collate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import conftest  # pylint: disable=wrong-import-position
import view  # pylint: disable=wrong-import-position


@pytest.fixture(scope="module")
def tok():
  return T.load_tokenizer()


def _episodes(tok, window=None):
  """Two groups of three; episode k has k + 2 turns; returns 1, 0, .5."""
  enc = lambda s: T.encode(tok, s)
  out = []
  for g in range(2):
    for k, r in enumerate([1.0, 0.0, 0.5]):
      segs = [Segment(Role.SYSTEM, enc("Walk to G. <b>&amp;</b>\n"))]
      for t in range(2 + k):
        a = enc(f"<move>left {t}</move>")
        segs += [Segment(Role.ASSISTANT, a, [-0.1 * (t + 1)] * len(a)),
                 Segment(Role.OBSERVATION, enc(f"\nYou moved ü {t}.\n"))]
      starts = None if window is None else [max(1, 2 * t + 1 - 2 * (window - 1))
                                            for t in range(2 + k)]
      out.append(Trajectory(segs, reward=r, turn_rewards=[0.0] * (1 + k) + [r],
                            terminated=True, context_starts=starts,
                            metadata={"group_id": g, "task_id": f"task{g}", "success": r == 1,
                                      "stop_reason": "terminated",
                                      "turn_reward_parts": [{"outcome": 0.0}] * (1 + k)
                                      + [{"outcome": r}]}))
  return out


@pytest.mark.parametrize("window", [None, 1])
def test_records_hold_what_the_batch_trained(tok, window):
  trajs = _episodes(tok, window)
  batch = credit.assign("turn_returns", trajs, collate(trajs, buckets=(128,)), gamma=0.5)
  trainer = np.where(batch.loss_mask > 0, -np.arange(batch.tokens.size).reshape(
      batch.tokens.shape) / 1000.0, 0.0)
  for i, traj in enumerate(trajs):
    rec = viewer.episode_record(traj, tok, iteration=3, phase="train", batch=batch, seq=i,
                                trainer_logprobs=trainer)
    ids, mask = traj.flatten()
    assert rec["tokens"] == ids.tolist() and rec["loss_mask"] == mask.astype(int).tolist()
    assert "".join(rec["pieces"]) == tok.decode(ids)
    on = np.asarray(rec["loss_mask"]) > 0
    assert all(r == "assistant" for r, m in zip(rec["role"], on) if m)
    # Each action token carries the batch's values for its (episode, turn),
    # in order: the advantages are the returns-to-go at gamma .5.
    returns = [traj.turn_rewards[-1] * 0.5 ** (traj.num_turns - 1 - t)
               for t in range(traj.num_turns)]
    for t in range(traj.num_turns):
      at = [j for j, turn in enumerate(rec["turn"]) if turn == t]
      assert [rec["advantage"][j] for j in at] == pytest.approx([returns[t]] * len(at))
      trained = (batch.seq_ids == i) & (batch.turn_index == t) & (batch.loss_mask > 0)
      assert [rec["trainer_logprob"][j] for j in at] == pytest.approx(trainer[trained].tolist())
      assert [rec["sampler_logprob"][j] for j in at] == pytest.approx([-0.1 * (t + 1)] * len(at))
    assert all(rec[k][j] is None for j in np.flatnonzero(~on)
               for k in ("advantage", "trainer_logprob", "sampler_logprob"))
    if window is None:
      assert rec["window_start"] is None
    else:  # the prompt, then the last action and its observation's successor
      offsets = np.cumsum([0] + [len(s) for s in traj.segments])
      assert rec["window_start"] == [int(offsets[s]) for s in traj.context_starts]


def test_sample_groups_takes_the_best_and_the_worst(tok):
  trajs = _episodes(tok)
  assert viewer.sample_groups(trajs, 2) == [0, 1, 3, 4]
  assert viewer.sample_groups(trajs, 3) == [0, 1, 2, 3, 4, 5]


class _Spans(html.parser.HTMLParser):
  """Every token span of a page, and the panels' data attributes."""

  def __init__(self):
    super().__init__()
    self.spans, self.panels = [], []

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    if tag == "span" and "tok" in a.get("class", "").split():
      self.spans.append(a)
    if tag == "section":
      self.panels.append(a)


def _records(tok):
  trajs = _episodes(tok)
  batch = credit.assign("grpo", trajs, collate(trajs, buckets=(128,)))
  train = [viewer.episode_record(t, tok, iteration=it, phase="train", batch=batch, seq=i)
           for it in (10, 20) for i, t in enumerate(trajs)]
  return train + [viewer.episode_record(trajs[0], tok, iteration=20, phase="eval")]


def check_page(records, text):
  """Every action token of `records` coloured on the page, no other token;
  each token's hover text is its record's id, turn, log-probs and advantage."""
  page = _Spans()
  page.feed(text)
  assert len(page.panels) == len(records)
  flat = [(r, i) for r in records for i in range(len(r["tokens"]))]
  assert len(page.spans) == len(flat)
  for span, (rec, i) in zip(page.spans, flat):
    trained = rec["loss_mask"][i] == 1
    assert ("action" in span["class"]) == trained
    assert ("background" in span.get("style", "")) == trained
    adv, s, t = rec["advantage"][i], rec["sampler_logprob"][i], rec["trainer_logprob"][i]
    fmt = lambda x: "-" if x is None else f"{x:+.3f}"
    assert span["title"] == (
        f"id {rec['tokens'][i]} | turn {rec['turn'][i]} | sampler {fmt(s)} | trainer {fmt(t)}"
        f" | gap {fmt(None if s is None or t is None else t - s)} | advantage {fmt(adv)}")
  return page


def test_page_colours_every_action_token_and_no_other(tok):
  records = _records(tok)
  text = viewer.render(records)
  page = check_page(records, text)
  # Reward parts are named where not 0: "turn 2 · reward +1.000 (outcome +1.00)".
  assert "reward +1.000 (outcome +1.00)" in text and "reward +0.000 (" not in text
  # GRPO's +-1.22 at both ends of the scale; an eval action has no advantage.
  colours = {s["style"] for s in page.spans if "action" in s["class"]}
  assert {"background:rgb(180,4,38)", "background:rgb(59,76,192)",
          "background:#fff3b0"} <= colours
  assert [p["data-phase"] for p in page.panels].count("eval") == 1


def test_the_page_runs_in_a_real_browser(tok, tmp_path):
  conftest.require_browser()
  viewer.write_jsonl(tmp_path / "trajectories.jsonl", _records(tok))
  page = view.write_page(tmp_path)
  run = view.browse(page, screenshot=tmp_path / "shot.png")
  dom = run.stdout
  assert 'data-ready="1"' in dom and "data-error" not in dom, run.stderr[-2000:]
  main = dom[dom.index("<main>"):dom.index("</main>")]
  assert main.count('<section class="episode"') == 13 and "13 of 13 episodes" in dom
  # The side-by-side view cloned task0's panels at its first and last
  # (iteration, phase) into the comparison.
  compare = dom[dom.index('id="compare"'):dom.index("<main>")]
  assert compare.count('<section class="episode"') == 2
  assert 'data-iteration="10" data-phase="train"' in compare
  assert 'data-iteration="20" data-phase="eval"' in compare
  assert "Uncaught" not in run.stderr and "CONSOLE" not in run.stderr
  assert (tmp_path / "shot.png").stat().st_size > 10_000


def test_view_renders_one_phase(tok, tmp_path):
  viewer.write_jsonl(tmp_path / "trajectories.jsonl", _records(tok))
  page = _Spans()
  page.feed(view.write_page(tmp_path, tmp_path / "eval.html", phase="eval").read_text())
  assert [p["data-phase"] for p in page.panels] == ["eval"]


def test_a_missing_browser_skips_with_its_package_name_and_fails_ci(monkeypatch):
  def missing():
    raise FileNotFoundError("no Chromium found")
  monkeypatch.setattr(view, "chromium", missing)
  monkeypatch.delenv("AGENTRL_REQUIRE_BROWSER", raising=False)
  with pytest.raises(pytest.skip.Exception, match="Debian's `chromium` package"):
    conftest.require_browser()
  monkeypatch.setenv("AGENTRL_REQUIRE_BROWSER", "1")  # as .ci/run sets it
  with pytest.raises(pytest.fail.Exception, match="AGENTRL_REQUIRE_BROWSER=1"):
    conftest.require_browser()
  assert "export AGENTRL_REQUIRE_BROWSER=1" in (
      pathlib.Path(__file__).resolve().parents[1] / ".ci/run").read_text()
