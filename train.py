"""ember's entry point.

  python train.py --config=configs/default.py[:PRESET] [--config.KEY=VALUE ...]
  python train.py --help

A bad flag, config value or input path exits with status 2 and one line on stderr; ember/errors.py lists
every exit status.
"""

import sys


def main(argv: list[str]) -> int:
  from ember.errors import Diverged, EmberError, fail_and_exit
  if any(a in ("-h", "--help", "-help") for a in argv[1:]):
    from ember.config import usage
    print(usage())
    return 0
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
