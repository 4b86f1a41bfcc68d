"""ember's entry point.

  python train.py --config=configs/default.py[:PRESET] [--config.KEY=VALUE ...]
  python train.py --help

A bad flag, config value or input path exits with status 2 and one line on stderr; ember/errors.py lists
every exit status.
"""

import os
import sys
import time


def _first_process() -> bool:
  """Process 0 of the job, read from the launchers' variables: JAX, which knows it for sure, takes seconds to
  import."""
  return all(os.environ.get(k, "0") in ("", "0") for k in ("EMBER_PROCESS_ID", "SLURM_PROCID"))


def main(argv: list[str]) -> int:
  if any(a in ("-h", "--help", "-help") for a in argv[1:]):
    from ember.config import usage
    print(usage())
    return 0
  verbose = any(a.lower() in ("--config.log.verbose", "--config.log.verbose=true", "--config.log.verbose=1")
                for a in argv[1:])  # ember.native_output.verbose_requested, which JAX would load with.
  if not verbose:  # Before JAX loads: XLA reads its log level then (ember.native_output.quiet_xla).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if _first_process():  # Before the imports, on stdout (stderr is for the log): the run is seen to start at once.
    print(f"[{time.strftime('%H:%M:%S')}] ember: starting ({' '.join(argv[1:]) or 'no flags'}); loading JAX",
          flush=True)
  from ember import native_output
  from ember.errors import Diverged, EmberError, fail_and_exit
  native_output.quiet(argv)  # The C++ lines written straight to stdout and stderr (Gloo's; before logging is set).
  try:
    from ember.config import load
    from ember.plan.auto_remat import resolve
    from ember.trainer.loop import prepare, train
    cfg, mesh = prepare(load(argv))
    train(resolve(cfg, mesh), mesh)
  except (EmberError, Diverged) as e:
    fail_and_exit(e)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
