"""Weights & Biases: every metrics record also logged to a W&B run (`log.wandb_project`), process 0 only.

The run's id is kept in the workdir (`wandb_run_id`), so a resumed run continues the same W&B run rather than
starting a second one; a new run in that workdir (no checkpoint restored: metrics.jsonl starts over) starts a new
W&B run under a new id, since W&B would drop every step of it up to the last one the earlier run logged. W&B
refuses a step at or below one it already holds: records a crash logged past the restored step are not rewritten
there (metrics.jsonl is the record of truth; it is truncated to the restored step). W&B's own environment
applies: WANDB_MODE=offline writes the run under the workdir's `wandb/` for a later `wandb sync` (W&B's own files
are local: for a gs:// workdir, under ./wandb or WANDB_DIR).
"""

from __future__ import annotations

import os
import secrets

from ember import storage
from ember.errors import ConfigError, one_line


ID_FILE = "wandb_run_id"


def _run_id(workdir: str, new_run: bool) -> str:
  """This workdir's W&B run id, made and written (atomically) by its first run, and again by a new run there."""
  path = storage.join(workdir, ID_FILE)
  if not new_run:
    return storage.kept_id(path, 4)
  run_id = secrets.token_hex(4)
  storage.write_atomic(path, run_id)
  return run_id


class WandbRun:
  """A W&B run that takes the metrics records (`log`) as metrics.jsonl writes them; `start` opens it, once the run
  knows whether it resumed (MetricsWriter.truncate_after)."""

  def __init__(self, *, project: str, entity: str, name: str, workdir: str, config: dict):
    self._args = dict(project=project, entity=entity or None, name=name or os.path.basename(workdir),
                      config=config)
    self._workdir = workdir
    self._run = None

  def start(self, *, new_run: bool) -> None:
    """Opens the W&B run: this workdir's last one continued, or a new one where `new_run`."""
    import wandb  # The optional extra; checked at validation (config.py).
    storage.makedirs(self._workdir)
    local = None if storage.is_remote(self._workdir) else self._workdir
    try:
      self._run = wandb.init(**self._args, id=_run_id(self._workdir, new_run), resume="allow", dir=local,
                             settings=wandb.Settings(console="off", quiet=True))
    except wandb.errors.Error as e:  # No API key, no network, an unknown entity: the user's to fix, in one line.
      raise ConfigError(f"config.log.wandb_project: W&B did not start ({one_line(e)}); run `wandb login`, or set "
                        "WANDB_MODE=offline to log locally for a later `wandb sync`") from None

  def log(self, scalars: dict, step: int) -> None:
    if self._run is None:
      self.start(new_run=False)
    self._run.log(scalars, step=step)

  def close(self, failed: bool = False) -> None:
    if self._run is not None:
      self._run.finish(exit_code=1 if failed else 0)
