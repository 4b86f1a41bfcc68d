"""The figures of the compile report and the planner (`--plot=FILE` on `ember.tools.compile` and `ember.tools.plan`),
drawn from the JSON they write, so a saved report draws again: `python -c "from ember.tools import figures; ..."`.
(The sweep and the convergence tool draw their own, beside their results; every figure is written by `save`.)"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ember import storage  # noqa: E402

_PART_COLORS = {"compute": "tab:blue", "memory": "tab:orange", "collectives": "tab:green", "host": "tab:brown"}
_KIND_COLORS = {"gemm": "tab:blue", "attention": "tab:purple", "memory": "tab:orange", "collective": "tab:green",
                "host": "tab:brown", "launch": "tab:gray"}


def save(fig, path: str) -> None:
  """`fig` as a PNG at `path`, replacing an earlier one whole (never half written), and closed."""
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=120)
  plt.close(fig)
  storage.write_bytes(path, png.getvalue())


def time_split(report: dict, path: str, top: int = 12) -> None:
  """A compile report's step: left, the roofline floor's parts (compute, memory, collectives, host transfers: the
  floor overlaps the last two with the rest) beside the predicted step; right, where the predicted time goes
  (`time_by_op`, the largest entries; exposed transfers hatched)."""
  fig, (split, ops) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 3]})
  parts = report["time_floor_parts_s"]
  left = 0.0
  for name in ("compute", "memory"):
    split.barh(["floor (serial parts)"], [parts[name] * 1e3], left=left, color=_PART_COLORS[name], label=name)
    left += parts[name] * 1e3
  for name in ("collectives", "host"):  # Overlapped with the rest: drawn after it, lighter.
    if parts.get(name):
      split.barh(["floor (serial parts)"], [parts[name] * 1e3], left=left, color=_PART_COLORS[name], label=name,
                 alpha=0.5)
      left += parts[name] * 1e3
  split.barh(["floor"], [report["time_floor_s"] * 1e3], color="tab:red", alpha=0.7)
  if report.get("predicted_step_s"):
    split.barh(["predicted"], [report["predicted_step_s"] * 1e3], color="black", alpha=0.7)
  split.set(xlabel="ms a step", title=f"{report['model']} on {report['target']}: {report['recipe']}, "
                                      f"remat {report['remat_policy']}")
  split.legend(fontsize=8, loc="lower right")
  merged: dict[str, dict] = {}  # One bar per op, pass and kind (the exposed and hidden parts of one summed).
  for e in report.get("time_by_op", []):
    label = f"{e['op']} ({e['pass']}, {e.get('kind', '?')})"
    m = merged.setdefault(label, {**e, "seconds": 0.0, "exposed": False})
    m["seconds"] += e["seconds"]
    m["exposed"] = m["exposed"] or bool(e.get("exposed"))
  largest = sorted(merged.items(), key=lambda item: -item[1]["seconds"])[:top][::-1]  # Drawn bottom up.
  labels, entries = [label for label, _ in largest], [e for _, e in largest]
  ops.barh(labels, [e["seconds"] * 1e3 for e in entries], color=[_KIND_COLORS.get(e.get("kind"), "tab:gray")
                                                                   for e in entries],
           hatch=["//" if e.get("exposed") and e.get("kind") in ("collective", "host") else "" for e in entries])
  ops.set(xlabel="ms a step (predicted)", title="where the predicted step goes (hatched: exposed transfers)")
  ops.tick_params(axis="y", labelsize=8)
  for ax in (split, ops):
    ax.grid(True, axis="x", alpha=0.3)
  fig.tight_layout()
  save(fig, path)


def layouts(result: dict, path: str) -> None:
  """The planner's candidates: predicted tokens/s per GPU (bars) and the roofline's ceiling (ticks), by layout,
  best first; a layout over the memory budget in grey, a failed one named with no bar."""
  compiled = [c for c in result["candidates"] if "fits" in c]
  failed = [c for c in result["candidates"] if "fits" not in c]
  fig, ax = plt.subplots(figsize=(11, 0.5 * (len(compiled) + len(failed)) + 1.8))
  names = [c["layout"] for c in compiled] + [f"{c['layout']} (failed)" for c in failed]
  predicted = [c["tokens_per_s_predicted"] for c in compiled] + [0] * len(failed)
  colors = ["tab:blue" if c["fits"] else "tab:gray" for c in compiled] + ["white"] * len(failed)
  ax.barh(names[::-1], predicted[::-1], color=colors[::-1], label="predicted")
  ax.scatter([c["tokens_per_s_ceiling"] for c in compiled][::-1], [c["layout"] for c in compiled][::-1], marker="|",
             s=300, color="tab:red", label="ceiling (roofline)", zorder=3)
  ax.set(xlabel="tokens/s per GPU",
         title=f"{result['model']}: layouts on {result['target']}, {result['recipe']} (grey: over the memory budget)")
  ax.tick_params(axis="y", labelsize=8)
  ax.grid(True, axis="x", alpha=0.3)
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  save(fig, path)
