"""Weights & Biases: every metrics record also logged to a W&B run (`log.wandb_project`), process 0 only.

The run's id is kept in the workdir (`wandb_run_id`), so a resumed run continues the same W&B run rather than
starting a second one. W&B refuses a step at or below one it already holds: records a crash logged past the restored
step are not rewritten there (metrics.jsonl is the record of truth; it is truncated to the restored step). W&B's
own environment applies: WANDB_MODE=offline writes the run under the workdir's `wandb/` for a later `wandb sync`
(W&B's own files are local: for a gs:// workdir, under ./wandb or WANDB_DIR).
"""

from __future__ import annotations

import os

from ember import storage
from ember.errors import ConfigError, one_line


ID_FILE = "wandb_run_id"


def _run_id(workdir: str) -> str:
  """This workdir's W&B run id, made and written (atomically) by its first run."""
  return storage.kept_id(storage.join(workdir, ID_FILE), 4)


class WandbRun:
  """A W&B run that takes the metrics records (`log`) as metrics.jsonl writes them."""

  def __init__(self, *, project: str, entity: str, name: str, workdir: str, config: dict):
    import wandb  # The optional extra; checked at validation (config.py).
    storage.makedirs(workdir)
    try:
      self._run = wandb.init(project=project, entity=entity or None,
                             name=name or os.path.basename(storage.absolute(workdir)),
                             id=_run_id(workdir), resume="allow", dir=None if storage.is_remote(workdir) else workdir,
                             config=config,
                             settings=wandb.Settings(console="off", quiet=True))
    except wandb.errors.Error as e:  # No API key, no network, an unknown entity: the user's to fix, in one line.
      raise ConfigError(f"config.log.wandb_project: W&B did not start ({one_line(e)}); run `wandb login`, or set "
                        "WANDB_MODE=offline to log locally for a later `wandb sync`") from None

  def log(self, scalars: dict, step: int) -> None:
    self._run.log(scalars, step=step)

  def close(self) -> None:
    self._run.finish()
