"""metrics.jsonl and TensorBoard: complete records only, NaN as null, resume truncation and purge."""

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time

from tensorboardX.proto import event_pb2

from ember.trainer.metrics import MetricsWriter, read_records


def test_torn_last_line_is_skipped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
  assert [r["step"] for r in read_records(str(path))] == [1, 2]


def test_nan_and_inf_are_written_as_null(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=False, enabled=True)
  w.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "mfu": None, "lr": 1e-3})
  line = (tmp_path / "metrics.jsonl").read_text()
  assert "NaN" not in line and "Infinity" not in line
  assert json.loads(line) == {"step": 1, "loss": None, "grad_norm": None, "mfu": None, "lr": 1e-3}


def test_resume_truncates_records_after_the_restored_step(tmp_path):
  w = MetricsWriter(str(tmp_path), tensorboard=False, enabled=True)
  for s in range(1, 6):
    w.write({"step": s, "loss": 1.0 / s})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "lo')  # A crash mid-write.
  w.truncate_after(3)
  assert [r["step"] for r in read_records(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
  w.write({"step": 4, "loss": 0.3})
  assert [r["step"] for r in read_records(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]


def _events(directory):
  """Every event of the TensorBoard files in `directory`, as (step, tag or 'session_log:<status>')."""
  out = []
  for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc.
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      if event.HasField("session_log"):
        out.append((event.step, f"session_log:{event.session_log.status}"))
      for v in event.summary.value:
        out.append((event.step, v.tag))
  return out


def test_tensorboard_is_purged_on_resume(tmp_path):
  """A resumed run tells TensorBoard to hide the old events from the restored step on (SessionLog START at
  step + 1), then writes the new ones."""
  w = MetricsWriter(str(tmp_path), tensorboard=True, enabled=True)
  for s in range(1, 6):
    w.write({"step": s, "loss": 1.0 / s})
  w.close()
  time.sleep(1.1)  # Event file names carry the second they were opened in.
  resumed = MetricsWriter(str(tmp_path), tensorboard=True, enabled=True)
  resumed.truncate_after(3)
  resumed.write({"step": 4, "loss": 0.5})
  resumed.close()
  events = _events(tmp_path / "tensorboard")
  assert [s for s, tag in events if tag == "loss"] == [1, 2, 3, 4, 5, 4]
  purge = [s for s, tag in events if tag.startswith("session_log")]
  assert purge == [4]  # START at step 4: readers drop the earlier file's events at steps >= 4.


def test_tensorboard_writes_without_loading_torch(tmp_path):
  """tensorboardX imports torch wherever it is installed (seconds at every start): a run's writer writes its events
  without it, and torch, where installed, still imports afterwards. In a process of its own: this one has loaded
  tensorboardX (and torch with it) already."""
  then = "import torch" if importlib.util.find_spec("torch") else "pass"
  code = (f"import sys; from ember.trainer.metrics import MetricsWriter; w = MetricsWriter({str(tmp_path)!r}, "
          "enabled=True); w.write({'step': 1, 'loss': 2.0}); w.close(); assert 'torch' not in sys.modules, "
          f"'torch was loaded'; {then}")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                          "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-2000:]
  assert [s for s, tag in _events(tmp_path / "tensorboard") if tag == "loss"] == [1]
