"""`quant.schedule`: which quant.* settings apply from which step (a precision schedule, e.g. NVFP4 for most of
the run and a bf16 forward for the end). Parsed here, the one place: config.validate checks it before
anything is built, and trainer/precision.py switches the train step at each phase's first step.
"""

from __future__ import annotations

import ml_collections

from ember.errors import bad_key


def precision_phases(cfg) -> list[tuple[int, ml_collections.ConfigDict]]:
  """[(first step, config)] of `quant.schedule`: the config itself from step 0, then each entry's overrides
  of quant.* on top of the phase before, from step `when` (an int >= 1) or round(when * steps) (a float in
  (0, 1)). Steps count from 0: phase i runs steps [start_i, start_{i+1}). Raises ConfigError on a bad entry."""
  schedule = cfg.quant.schedule
  if not isinstance(schedule, (tuple, list)):
    bad_key("quant.schedule", f"must be a tuple of (step or fraction, {{quant key: value}}) entries, got {schedule!r}")
  phases = [(0, cfg)]
  for index, entry in enumerate(schedule):
    key = f"quant.schedule[{index}]"
    if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[1], dict):
      bad_key(key, f"must be (step or fraction, {{quant key: value}}), got {entry!r}")
    when, overrides = entry
    if isinstance(when, bool) or not isinstance(when, (int, float)):
      bad_key(key, f"the step must be an int or a fraction of steps in (0, 1), got {when!r}")
    start = when if isinstance(when, int) else round(when * cfg.steps)
    if isinstance(when, float) and not 0 < when < 1:
      bad_key(key, f"a fraction of steps must be in (0, 1), got {when!r}")
    if not 1 <= start < cfg.steps:
      fraction = "" if isinstance(when, int) else f" (round({when!r} x steps={cfg.steps}))"
      bad_key(key, f"starts at step {start}{fraction}, outside [1, steps={cfg.steps})")
    if start <= phases[-1][0]:
      bad_key(key, f"starts at step {start}, not after the entry before it (step {phases[-1][0]})")
    unknown = next((k for k in overrides if k not in cfg.quant or k == "schedule"), None)
    if unknown is not None or not overrides:
      bad_key(key, f"overrides quant.* keys (not schedule), got {unknown if overrides else 'none'!r}")
    phase = ml_collections.ConfigDict(phases[-1][1].to_dict())
    for k, v in overrides.items():
      try:
        phase.quant[k] = tuple(v) if isinstance(v, list) else v
      except (TypeError, ValueError) as e:  # ml_collections refuses a value of another type than the key's.
        bad_key(key, f"quant.{k}: {v!r} does not fit this key ({type(e).__name__}: {str(e).splitlines()[0]})")
    phases.append((start, phase))
  return phases


