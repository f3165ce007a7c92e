"""A static, self-contained HTML page of episode records (`records.py`).

One panel per episode, turns separated; action tokens (the loss mask) are
coloured by their advantage on a diverging scale (blue below 0, red above,
the same scale on the whole page; a sampled action without an advantage,
e.g. in evaluation, is tinted yellow), prompt and observation tokens are
grey: untrained. Hovering a token shows its id, the sampler's and the
trainer's log-probs, their gap and its advantage. Filters by iteration,
phase, label, stop reason, success and reward; a side-by-side of one task
at two iterations (or under two labels). No server, no network: the
page's script and style are inline.
"""

from __future__ import annotations

import html
from typing import Sequence

_UNSCORED = "#fff3b0"  # a sampled action token with no advantage (evaluation)

_STYLE = """
body { font: 13px/1.45 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
.controls { position: sticky; top: 0; background: #fafafa; border: 1px solid #ddd;
  padding: 8px; margin-bottom: 12px; z-index: 2; display: flex; flex-wrap: wrap; gap: 10px; }
.controls label { white-space: nowrap; }
.legend { display: inline-flex; align-items: center; gap: 4px; }
.bar { width: 160px; height: 10px; background: linear-gradient(to right, rgb(59,76,192),
  #fff, rgb(180,4,38)); border: 1px solid #ccc; }
.episode { border: 1px solid #ccc; border-radius: 4px; margin-bottom: 14px; }
.episode > header { background: #f0f0f0; padding: 4px 8px; font-weight: 600; }
.episode .ok { color: #17803d; } .episode .fail { color: #b42318; }
.turns { padding: 6px 8px; }
.turn { border-top: 1px dashed #bbb; padding: 4px 0; }
.turn .tag { font-size: 11px; color: #666; margin-right: 6px; }
.text { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.tok { border-radius: 2px; }
.tok.untrained { color: #999; }
.tok.action { color: #000; outline: 1px solid rgba(0,0,0,.08); }
.tok:hover { outline: 2px solid #000; }
#compare { display: grid; grid-template-columns: 1fr 1fr; gap: 10px; }
.hidden { display: none; }
"""

_SCRIPT = """
window.onerror = function (msg) { document.body.dataset.error = String(msg); };
(function () {
  const panels = Array.from(document.querySelectorAll('section.episode'));
  const $ = id => document.getElementById(id);
  function fill(select, values) {
    for (const v of values) {
      const o = document.createElement('option'); o.value = o.textContent = v;
      select.appendChild(o);
    }
  }
  const uniq = key => Array.from(new Set(panels.map(p => p.dataset[key]))).sort(
      (a, b) => (isNaN(a) || isNaN(b)) ? a.localeCompare(b) : a - b);
  for (const key of ['iteration', 'phase', 'label', 'stop']) fill($('f-' + key), uniq(key));
  function apply() {
    const lo = parseFloat($('f-min').value), hi = parseFloat($('f-max').value);
    const outcome = $('f-success').value;
    let shown = 0;
    for (const p of panels) {
      let ok = true;
      for (const key of ['iteration', 'phase', 'label', 'stop']) {
        const v = $('f-' + key).value;
        if (v !== '*' && p.dataset[key] !== v) ok = false;
      }
      const r = parseFloat(p.dataset.reward);
      if (!isNaN(lo) && r < lo) ok = false;
      if (!isNaN(hi) && r > hi) ok = false;
      if (outcome !== '*' && p.dataset.success !== outcome) ok = false;
      p.classList.toggle('hidden', !ok);
      shown += ok;
    }
    $('shown').textContent = shown + ' of ' + panels.length + ' episodes';
  }
  for (const el of document.querySelectorAll('.controls select, .controls input'))
    el.addEventListener('input', apply);
  // Side by side: the first episode of a task at each of two iterations/labels.
  const key = p => p.dataset.iteration + ' ' + p.dataset.phase + ' ' + p.dataset.label;
  fill($('c-task'), uniq('task'));
  function options() {
    const task = $('c-task').value;
    const keys = Array.from(new Set(panels.filter(p => p.dataset.task === task).map(key)));
    for (const s of [$('c-a'), $('c-b')]) { s.innerHTML = ''; fill(s, keys); }
    if (keys.length > 1) $('c-b').value = keys[keys.length - 1];
    compare();
  }
  function compare() {
    const box = $('compare'); box.innerHTML = '';
    for (const s of [$('c-a'), $('c-b')]) {
      const p = panels.find(p => p.dataset.task === $('c-task').value && key(p) === s.value);
      if (p) { const c = p.cloneNode(true); c.classList.remove('hidden'); box.appendChild(c); }
    }
  }
  $('c-task').addEventListener('input', options);
  $('c-a').addEventListener('input', compare);
  $('c-b').addEventListener('input', compare);
  options();
  apply();
  document.body.dataset.ready = '1';
})();
"""


def _colour(value: float, scale: float) -> str:
  """Diverging: white at 0, blue (negative) or red (positive) at |scale|."""
  x = max(-1.0, min(1.0, value / scale))
  end = (180, 4, 38) if x > 0 else (59, 76, 192)
  a = abs(x)
  return "rgb({},{},{})".format(*(round(255 + (c - 255) * a) for c in end))


def _fmt(x) -> str:
  return "-" if x is None else f"{x:+.3f}"


def _hover(rec: dict, i: int) -> str:
  s, t = rec["sampler_logprob"][i], rec["trainer_logprob"][i]
  gap = None if s is None or t is None else t - s
  return (f"id {rec['tokens'][i]} | turn {rec['turn'][i]} | sampler {_fmt(s)} | "
          f"trainer {_fmt(t)} | gap {_fmt(gap)} | advantage {_fmt(rec['advantage'][i])}")


def _token(rec: dict, i: int, scale: float) -> str:
  piece = html.escape(rec["pieces"][i])
  hover = html.escape(_hover(rec, i), quote=True)
  if rec["loss_mask"][i]:
    adv = rec["advantage"][i]
    colour = _UNSCORED if adv is None else _colour(adv, scale)
    return (f'<span class="tok action" style="background:{colour}" '
            f'data-i="{i}" title="{hover}">{piece}</span>')
  return f'<span class="tok untrained" data-i="{i}" title="{hover}">{piece}</span>'


def _panel(rec: dict, scale: float) -> str:
  # A new block at each action's first token: the prompt, then turn by turn.
  blocks, current, turn = [], [], None
  for i, t in enumerate(rec["turn"]):
    if t >= 0 and t != turn:
      blocks.append((turn, current))
      current, turn = [], t
    current.append(_token(rec, i, scale))
  blocks.append((turn, current))
  rewards, parts = rec["turn_rewards"], rec["turn_reward_parts"]
  body = []
  for turn, toks in blocks:
    if turn is None:
      tag = "prompt"
    else:
      tag = f"turn {turn}"
      if turn < len(rewards):
        tag += f" · reward {rewards[turn]:+.3f}"
      named = ", ".join(f"{k} {v:+.2f}" for k, v in (parts[turn] if turn < len(parts)
                                                      else {}).items() if v)
      if named:
        tag += f" ({named})"
      if rec["window_start"] is not None and turn < len(rec["window_start"]):
        tag += f" · context from token {rec['window_start'][turn]}"
    body.append(f'<div class="turn"><span class="tag">{html.escape(tag)}</span>'
                f'<span class="text">{"".join(toks)}</span></div>')
  outcome = '<span class="ok">success</span>' if rec["success"] else '<span class="fail">fail</span>'
  label = f" · {html.escape(rec['label'])}" if rec.get("label") else ""
  head = (f"{html.escape(str(rec['task_id']))} · iteration {rec['iteration']} "
          f"({html.escape(rec['phase'])}){label} · return {rec['reward']:+.3f} · {outcome} · "
          f"{html.escape(str(rec['stop_reason']))}"
          + (" · truncated" if rec["truncated"] else ""))
  attrs = {"iteration": rec["iteration"], "phase": rec["phase"], "label": rec.get("label") or "",
           "stop": rec["stop_reason"], "success": str(rec["success"]).lower(),
           "reward": rec["reward"], "task": rec["task_id"]}
  data = " ".join(f'data-{k}="{html.escape(str(v), quote=True)}"' for k, v in attrs.items())
  return (f'<section class="episode" {data}><header>{head}</header>'
          f'<div class="turns">{"".join(body)}</div></section>')


def render(records: Sequence[dict], title: str = "Trajectories") -> str:
  """The page for `records`, as one HTML string."""
  advs = [abs(a) for r in records for a in r["advantage"] if a is not None]
  scale = max(advs) if advs and max(advs) > 0 else 1.0
  select = lambda name, text: (f'<label>{text} <select id="f-{name}">'
                               f'<option value="*">all</option></select></label>')
  controls = "".join([
      select("iteration", "iteration"), select("phase", "phase"), select("label", "label"),
      select("stop", "stop reason"),
      '<label>outcome <select id="f-success"><option value="*">all</option>'
      '<option value="true">success</option><option value="false">fail</option></select></label>',
      '<label>return from <input id="f-min" type="number" step="0.1" size="5"> '
      'to <input id="f-max" type="number" step="0.1" size="5"></label>',
      '<span id="shown"></span>',
      f'<span class="legend">advantage {-scale:.2f} <span class="bar"></span> '
      f'{scale:+.2f}; untrained tokens grey</span>'])
  compare = ('<details><summary>side by side</summary><div class="controls">'
             '<label>task <select id="c-task"></select></label>'
             '<label>left <select id="c-a"></select></label>'
             '<label>right <select id="c-b"></select></label></div>'
             '<div id="compare"></div></details>')
  panels = "".join(_panel(r, scale) for r in records)
  return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
          f'<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>'
          f'<h1>{html.escape(title)}</h1><div class="controls">{controls}</div>{compare}'
          f'<main>{panels}</main><script>{_SCRIPT}</script></body></html>')
