"""ember's entry point.

  python train.py --config=configs/default.py[:PRESET] [--config.KEY=VALUE ...]

A bad flag, config value or input path exits with status 2 and one line on stderr.
"""

import sys


def main(argv: list[str]) -> int:
  from ember.config import ConfigError, fail_and_exit, load
  from ember.data import DataError
  from ember.trainer.checkpointing import CheckpointError
  try:
    cfg = load(argv)
    from ember.trainer.loop import train
    train(cfg)
  except (ConfigError, DataError, CheckpointError) as e:
    fail_and_exit(e)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
