"""ember's entry point.

  python train.py --config=configs/default.py[:PRESET] [--config.KEY=VALUE ...]
  python train.py --help

A bad flag, config value or input path exits with status 2 and one line on stderr; ember/errors.py lists
every exit status.
"""

import sys
import time


def main(argv: list[str]) -> int:
  if any(a in ("-h", "--help", "-help") for a in argv[1:]):
    from ember.config import usage
    print(usage())
    return 0
  from ember import native_output  # Imports no JAX (nor does `import ember`).
  native_output.quiet(argv)  # Before JAX loads: XLA reads its log level then.
  from ember.errors import first_process  # A leaf module: no JAX.
  if first_process():  # Before the imports, on stdout (stderr is for the log): the run is seen to start at once.
    print(f"[{time.strftime('%H:%M:%S')}] ember: starting ({' '.join(argv[1:]) or 'no flags'}); loading JAX",
          flush=True)
  from ember.errors import Diverged, EmberError, fail_and_exit, out_of_memory_exit
  try:
    from ember.config import load, validate
    from ember.plan.auto_remat import resolve
    from ember.trainer.loop import prepare, train
    from ember import collect_for_tracing
    collect_for_tracing()
    settings, mesh = prepare(validate(load(argv), None))  # The config checked before the job is joined.
    last = train(resolve(settings, mesh), mesh)
  except (EmberError, Diverged) as e:
    fail_and_exit(e)
  except Exception as e:  # XLA's out of memory, compiling or running a step: one line, not its traceback.
    return out_of_memory_exit(e)
  return settings.train.preempted_exit_status if last.get("preempted") else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
