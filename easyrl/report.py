"""`easyrl report RUN_DIR`: one self-contained HTML page summarizing a run from its file logger output.

Reads `experiment_log.jsonl` (one JSON object per logged step) and `generations.jsonl` (validation
generations) from the run folder, draws the training curves with matplotlib, and writes an HTML page with the
plots embedded as base64 PNGs (also written as files next to it) and a filterable table of the generations.
The page needs no network: CSS and JavaScript are inline. Metrics a run did not log are left out.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from string import Template
from typing import Any

from easyrl.report_samples import samples_section


logger = logging.getLogger(__name__)

Series = dict[str, tuple[list[int], list[float]]]
# Reward-function health counters logged under reward/: not scores, so not drawn with the sub-scores.
_REWARD_COUNTERS = {"reward/errors", "reward/invalid", "reward/timeouts", "reward/retried_chunks"}
# `easyrl.algorithms.logprob_gap`'s figure and NeMo-RL's bound on it, written out here so that the report imports no
# torch (tests/test_report.py keeps the two equal).
TOKEN_PROB_ERROR = "rollout/token_prob_error"
TOKEN_PROB_ERROR_GATE = 1.05


@dataclass
class Plot:
    """One figure of the report: a title, the series it draws and how."""

    name: str
    title: str
    ylabel: str
    keys: list[str]
    emphasize: str | None = None  # drawn thicker, on top
    sparse: tuple[str, ...] = ()  # drawn with markers (validation runs only every few steps)
    total: str | None = None  # drawn dashed, as the sum the others are parts of
    gate: float | None = None  # drawn as a dotted horizontal line: the bound the metric should stay at or under


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file; unreadable lines (a run killed mid-write) are skipped with a warning."""
    if not os.path.isfile(path):
        return []
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            # ValueError covers a decode error and an integer past Python's 4,300-digit limit; RecursionError, a
            # line nested thousands deep. Neither is a row a run wrote.
            except (ValueError, RecursionError):
                logger.warning("%s:%d is not valid JSON; skipped", path, number)
                continue
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


def metric_series(rows: list[dict[str, Any]]) -> Series:
    """Per metric key, its (steps, values), sorted by step. A step logged twice (a resumed run) keeps the later
    value; non-numeric values are ignored."""
    by_step: dict[int, dict[str, float]] = {}
    odd = [row["step"] for row in rows if "step" in row and _step_of(row["step"]) is None]
    if odd:  # a hand-edited or foreign log: one line, not a traceback (bool, "3", 1.5, null are no step numbers)
        logger.warning(
            "%d logged rows have a step that is not an integer (first: %s); skipped", len(odd), repr(odd[0])[:40]
        )
    for row in rows:
        step = _step_of(row.get("step"))
        if step is None:
            continue
        values = by_step.setdefault(step, {})
        for key, value in row.items():
            number = _number(value)
            if key != "step" and number is not None:
                values[key] = number
    series: Series = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            xs, ys = series.setdefault(key, ([], []))
            xs.append(step)
            ys.append(value)
    return series


def _step_of(value: Any) -> int | None:
    """`value` as a step number: an int, or a float holding one (JSON writers may print 3.0); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) < 2**63 else None  # beyond any run's steps, and beyond what a plot can place
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _number(value: Any) -> float | None:
    """`value` as a float when it is a JSON number a float can hold (an integer of 400 digits is not); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def plan_plots(series: Series) -> list[Plot]:
    """The figures the logged metrics call for, in page order; empty figures are left out."""

    def having(pred: Callable[[str], bool]) -> list[str]:
        return sorted(k for k in series if pred(k))

    plots = [
        Plot(
            "reward",
            "Reward (overall and sub-scores)",
            "score",
            having(lambda k: k.startswith("reward/") and k not in _REWARD_COUNTERS)
            + having(lambda k: k == "val/reward_score"),
            emphasize="reward/overall",
            sparse=("val/reward_score",),
        ),
        Plot("response_length", "Response length", "tokens", having(lambda k: k.startswith("response_length/"))),
        Plot("kl", "KL", "kl", having(lambda k: k in ("actor/kl_loss", "actor/reward_kl_penalty"))),
        Plot("entropy", "Entropy", "nats / token", having(lambda k: k in ("actor/entropy", "actor/entropy_rollout"))),
        # NeMo-RL's training-inference mismatch figure, with the bound its recipes gate on (algorithms/logprob_gap.py)
        Plot(
            "token_prob_error",
            "Engine vs trainer: mean exp(|log p_engine - log p_trainer|)",
            "token prob error",
            having(lambda k: k == TOKEN_PROB_ERROR),
            gate=TOKEN_PROB_ERROR_GATE,
        ),
        Plot("grad_norm", "Gradient norm", "norm", having(lambda k: k.endswith("/grad_norm"))),
        Plot("throughput", "Throughput", "tokens / s / device", having(lambda k: k == "perf/throughput")),
        # The memory ledger (easyrl.distributed.memory): each role at its phase boundaries and phase peaks.
        Plot("memory", "Memory per role and phase", "GiB", having(lambda k: k.startswith("perf/mem/"))),
        Plot(
            "timing",
            "Stage timings per step",
            "seconds",
            having(lambda k: k.startswith("timing_s/")),
            total="timing_s/step",
        ),
        Plot("reward_health", "Reward function problems", "count", having(lambda k: k in _REWARD_COUNTERS)),
    ]
    kept = []
    for plot in plots:
        if plot.name == "reward_health" and not any(y for k in plot.keys for y in series[k][1] if math.isfinite(y)):
            continue  # all zero: nothing to show
        if plot.keys:
            kept.append(plot)
    return kept


def render_png(plot: Plot, series: Series) -> bytes:
    """The plot as PNG bytes (matplotlib, no pyplot state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for key in plot.keys:
        xs, ys = series[key]
        # Metric names are data, never markup: `$` escaped so matplotlib shows `$\x$` instead of parsing it as math.
        label = key.removeprefix("timing_s/") if plot.name == "timing" else key
        label = _plain(label.removeprefix("perf/mem/").removesuffix("_gb") if plot.name == "memory" else label)
        if key == plot.total:
            ax.plot(xs, ys, "k--", linewidth=1.6, label=f"{label} (total)", zorder=3)
        elif key in plot.sparse:
            ax.plot(xs, ys, "o-", markersize=5, linewidth=1.2, label=label, zorder=4)
        elif key == plot.emphasize:
            ax.plot(xs, ys, linewidth=2.4, label=label, zorder=5)
        else:
            ax.plot(xs, ys, linewidth=1.2, label=label, alpha=0.9)
    if plot.gate is not None:
        ax.axhline(plot.gate, color="tab:red", linestyle=":", linewidth=1.4, label=f"gate ({plot.gate:g})")
    ax.set_title(plot.title)
    ax.set_xlabel("step")
    ax.set_ylabel(plot.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # outside: never on a curve
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _plain(text: str) -> str:
    """`text` as matplotlib shows it literally (mathtext reads `$...$` as TeX, and bad TeX raises)."""
    return text.replace("$", r"\$")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def summary_rows(series: Series) -> list[tuple[str, str]]:
    """Headline numbers: steps, final and best rewards, final length, total time."""
    rows: list[tuple[str, str]] = []
    steps = sorted({s for xs, _ in series.values() for s in xs})
    if steps:
        rows.append(("steps logged", f"{len(steps)} (step {steps[0]} to {steps[-1]})"))
    for key, label in (("reward/overall", "final reward/overall"), ("response_length/mean", "final response length")):
        if key in series:
            rows.append((label, _fmt(series[key][1][-1])))
    if "val/reward_score" in series:
        xs, ys = series["val/reward_score"]
        finite = [(y, x) for x, y in zip(xs, ys) if math.isfinite(y)]
        if finite:
            best, at = max(finite)
            rows.append(("best val/reward_score", f"{_fmt(best)} (step {at})"))
        rows.append(("final val/reward_score", _fmt(ys[-1])))
    if "timing_s/step" in series:
        total = sum(y for y in series["timing_s/step"][1] if math.isfinite(y))
        rows.append(("training time (sum of timing_s/step)", f"{total / 60:.1f} min"))
    return rows


def _generation_row(row: dict[str, Any]) -> str:
    score = _number(row.get("score"))
    score_text = _fmt(score) if score is not None else ""
    cls = "good" if score is not None and score > 0 else "bad"
    cells = [
        f'<td class="num">{html.escape(str(row.get("step", "")))}</td>',
        f'<td><div class="text">{html.escape(str(row.get("prompt", "")))}</div></td>',
        f'<td><div class="text">{html.escape(str(row.get("response", "")))}</div></td>',
        f'<td><div class="text">{html.escape(str(row.get("ground_truth", "")))}</div></td>',
        f'<td class="num {cls}">{html.escape(score_text)}</td>',
    ]
    return f'<tr data-step="{html.escape(str(row.get("step", "")))}">' + "".join(cells) + "</tr>"


def build_report(run_dir: str, output: str | None = None) -> str:
    """Write the report of `run_dir` to `output` (default `<run_dir>/report.html`); returns its path.

    The PNG of each plot is written next to it as `<output stem>_<plot>.png`.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError("easyrl report draws its plots with matplotlib: pip install matplotlib") from exc
    log_path = os.path.join(run_dir, "experiment_log.jsonl")
    gen_path = os.path.join(run_dir, "generations.jsonl")
    if not os.path.isfile(log_path) and not os.path.isfile(gen_path):
        raise FileNotFoundError(
            f"{run_dir} has neither experiment_log.jsonl nor generations.jsonl: point at a run folder written with "
            "the file logger (trainer.logger includes 'file')"
        )
    series = metric_series(read_jsonl(log_path))
    generations = read_jsonl(gen_path)
    output = output or os.path.join(run_dir, "report.html")
    out_dir = os.path.dirname(os.path.abspath(output))
    stem = os.path.splitext(os.path.basename(output))[0]
    check_output(output, [os.path.join(out_dir, f"{stem}_{plot.name}.png") for plot in plan_plots(series)])
    os.makedirs(out_dir, exist_ok=True)

    figures = []
    for plot in plan_plots(series):
        png = render_png(plot, series)
        png_name = f"{stem}_{plot.name}.png"
        with open(os.path.join(out_dir, png_name), "wb") as f:
            f.write(png)
        data = base64.b64encode(png).decode("ascii")
        figures.append(
            f'<figure id="plot-{plot.name}"><img alt="{html.escape(plot.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(plot.title)} ({html.escape(', '.join(plot.keys))})</figcaption></figure>"
        )
    steps = sorted({str(r.get("step", "")) for r in generations}, key=lambda s: (len(s), s))
    page = _PAGE.substitute(
        title=html.escape(f"easyrl report: {os.path.basename(os.path.abspath(run_dir))}"),
        run_dir=html.escape(os.path.abspath(run_dir)),
        summary="".join(
            f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(series)
        )
        or '<tr><td colspan="2">no metrics logged</td></tr>',
        figures="\n".join(figures) or '<p class="empty">No metrics to plot.</p>',
        step_options="".join(f'<option value="{html.escape(s)}">step {html.escape(s)}</option>' for s in steps),
        generation_rows="\n".join(_generation_row(r) for r in generations),
        generation_count=len(generations),
        samples=samples_section(run_dir),
    )
    with open(output, "w", encoding="utf-8") as f:
        f.write(page)
    logger.info("report: %s (%d plots, %d generations)", output, len(figures), len(generations))
    return output


# Identifies a page this command wrote, the one kind of existing file `--output` may replace. Pages written before
# the tag are recognised by their title.
_GENERATOR_TAG = b'<meta name="generator" content="easyrl report">'
_OLD_TITLE = b"<title>easyrl report: "
# Inside a checkpoint (sealed, being written, or set aside by a save): its manifest, or a folder named as checkpoints are.
_CHECKPOINT_MANIFEST = "COMPLETE"
_CHECKPOINT_FOLDER = re.compile(r"^\.?(?:tmp_|old_|trash_)?global_step_\d+")


def _is_report(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    return _GENERATOR_TAG in head or _OLD_TITLE in head


def check_output(output: str, pngs: list[str]) -> None:
    """Refuse an `--output` that would replace anything but an earlier report, or that lies inside a checkpoint.

    Raises:
        FileExistsError: naming the file or checkpoint and the fix (nothing has been written yet).
    """
    target = os.path.realpath(output)  # through symlinks: a link to a run's file is that file
    folder = os.path.dirname(target)
    while True:
        if _CHECKPOINT_FOLDER.match(os.path.basename(folder)) or os.path.isfile(
            os.path.join(folder, _CHECKPOINT_MANIFEST)
        ):
            raise FileExistsError(
                f"--output {output} lies inside the checkpoint {folder}: a report is never written into a checkpoint "
                "(its files are sealed by the manifest); choose a path outside it"
            )
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    if os.path.lexists(output) and not (os.path.isfile(target) and _is_report(target)):
        raise FileExistsError(
            f"--output {output} exists and is not an earlier easyrl report: refusing to overwrite it; "
            "choose another path (or remove the file yourself)"
        )
    # The plots go next to the page as `<stem>_<plot>.png`: replaced only along with the earlier report they belong to.
    if not os.path.lexists(output):
        clobbered = [png for png in pngs if os.path.lexists(png)]
        if clobbered:
            raise FileExistsError(
                f"--output {output} would overwrite {clobbered[0]}, which belongs to no earlier report; choose another path"
            )


_PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="generator" content="easyrl report">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>
  body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2330; background: #f5f6f8; }
  header { background: #1d2330; color: #fff; padding: 16px 28px; }
  header h1 { margin: 0; font-size: 20px; }
  header p { margin: 4px 0 0; font-size: 13px; color: #b9c0cc; word-break: break-all; }
  main { padding: 20px 28px; max-width: 1500px; }
  section { background: #fff; border-radius: 8px; padding: 16px 20px; margin-bottom: 20px;
            box-shadow: 0 1px 3px rgba(0,0,0,.08); }
  h2 { font-size: 17px; margin: 0 0 12px; }
  table.summary th { text-align: left; font-weight: 500; padding: 3px 18px 3px 0; color: #5a6272; }
  .plots { display: flex; flex-wrap: wrap; gap: 14px; }
  figure { margin: 0; flex: 1 1 520px; max-width: 740px; }
  figure img { width: 100%; height: auto; border: 1px solid #e3e6eb; border-radius: 4px; }
  img.sample { width: 96px; height: 96px; image-rendering: pixelated; margin: 2px; }
  figcaption { font-size: 12px; color: #5a6272; margin-top: 2px; }
  .controls { display: flex; gap: 10px; align-items: center; margin-bottom: 10px; flex-wrap: wrap; }
  .controls input[type=search] { flex: 1 1 300px; padding: 6px 10px; font-size: 14px; border: 1px solid #c8cdd6;
                                 border-radius: 4px; }
  .controls select { padding: 5px; font-size: 14px; }
  #gen-count { font-size: 13px; color: #5a6272; }
  table.gens { border-collapse: collapse; width: 100%; font-size: 13px; table-layout: fixed; }
  table.gens th { background: #eef0f4; text-align: left; padding: 6px; position: sticky; top: 0; cursor: pointer; }
  table.gens td { border-top: 1px solid #e3e6eb; padding: 6px; vertical-align: top; }
  table.gens col.n { width: 60px; }
  .text { white-space: pre-wrap; word-break: break-word; max-height: 9em; overflow: auto; font-family: ui-monospace,
          "SFMono-Regular", Menlo, monospace; font-size: 12px; }
  .num { text-align: right; font-variant-numeric: tabular-nums; }
  .good { color: #137333; font-weight: 600; }
  .bad { color: #b3261e; }
  .empty { color: #5a6272; }
</style>
</head>
<body>
<header><h1>$title</h1><p>$run_dir</p></header>
<main>
<section><h2>Summary</h2><table class="summary">$summary</table></section>
<section><h2>Training curves</h2><div class="plots">
$figures
$samples
</div></section>
<section><h2>Validation generations</h2>
<div class="controls">
  <input id="gen-filter" type="search" placeholder="Filter: text in prompt, response or ground truth">
  <select id="gen-step"><option value="">all steps</option>$step_options</select>
  <label><input id="gen-failed" type="checkbox"> score &le; 0 only</label>
  <span id="gen-count">$generation_count generations</span>
</div>
<table class="gens" id="gens">
<colgroup><col class="n"><col><col><col style="width:14%"><col class="n"></colgroup>
<thead><tr><th data-col="0">step</th><th data-col="1">prompt</th><th data-col="2">response</th>
<th data-col="3">ground truth</th><th data-col="4">score</th></tr></thead>
<tbody>
$generation_rows
</tbody>
</table>
</section>
</main>
<script>
(function () {
  "use strict";
  var table = document.getElementById("gens");
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  var filter = document.getElementById("gen-filter");
  var step = document.getElementById("gen-step");
  var failed = document.getElementById("gen-failed");
  var count = document.getElementById("gen-count");
  function apply() {
    var needle = filter.value.toLowerCase();
    var shown = 0;
    rows.forEach(function (row) {
      var score = parseFloat(row.cells[4].textContent);
      var ok = (!needle || row.textContent.toLowerCase().indexOf(needle) !== -1)
        && (!step.value || row.getAttribute("data-step") === step.value)
        && (!failed.checked || !(score > 0));
      row.style.display = ok ? "" : "none";
      if (ok) { shown += 1; }
    });
    count.textContent = shown + " of " + rows.length + " generations";
  }
  var direction = {};
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
    th.addEventListener("click", function () {
      var col = parseInt(th.getAttribute("data-col"), 10);
      var numeric = col === 0 || col === 4;
      direction[col] = -(direction[col] || -1);
      rows.sort(function (a, b) {
        var x = a.cells[col].textContent, y = b.cells[col].textContent;
        var c = numeric ? (parseFloat(x) || 0) - (parseFloat(y) || 0) : x.localeCompare(y);
        return c * direction[col];
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
  filter.addEventListener("input", apply);
  step.addEventListener("change", apply);
  failed.addEventListener("change", apply);
  var match = /^#filter=(.*)$$/.exec(window.location.hash);  // report.html#filter=text links to a filtered view
  if (match) { filter.value = decodeURIComponent(match[1]); }
  apply();
})();
</script>
</body>
</html>
""")
