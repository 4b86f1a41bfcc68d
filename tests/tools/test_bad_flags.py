"""Each tool's bad flags and output paths: exit 2 with one line on stderr naming the flag, before any work
(no usage text, no traceback after a long compile). In-process: every case fails before JAX compiles."""

import pytest

from ember.data import train_tokenizer, write_array_record
from ember.tools import bench, cost_table
from ember.tools import compile as compile_tool
from ember.tools import export_hf, precision_probe, remat_report, sample, sweep
from tests.helpers import ROOT

TINY = f"--config={ROOT}/configs/default.py:tiny"
NOWHERE = "/nonexistent/dir"
FILE = str(ROOT / "README.md")  # An existing regular file.

CASES = [
    (compile_tool, [TINY], "--target: required, not given"),
    (compile_tool, [TINY, "--target=cpu", f"--out={NOWHERE}/r.json"], f"--out: cannot write {NOWHERE}/r.json: no directory"),
    (compile_tool, [TINY, "--target=cpu", f"--hlo_out={ROOT}"], f"--hlo_out: {ROOT} is a directory"),
    (remat_report, [TINY], "--out: required, not given"),
    (remat_report, [TINY, "--compile=maybe", "--out=r.json"], "--compile: invalid choice: 'maybe'"),
    (remat_report, [TINY, "--layer_batch=two", "--out=r.json"], "--layer_batch: invalid int value: 'two'"),
    (remat_report, [TINY, f"--out={NOWHERE}/r.json"], f"--out: cannot write {NOWHERE}/r.json: no directory"),
    (sweep, [TINY, "--grid=seed=0,1", "--steps=abc", "--out=o"], "--steps: invalid int value: 'abc'"),
    (sweep, [TINY, "--grid=seed=0,1", "--steps=2"], "--out: required, not given"),
    (sweep, [TINY, "--grid=seed=0,1", "--steps=2", f"--out={FILE}"], f"--out: {FILE} exists and is not a directory"),
    (sweep, [TINY, "--grid=seed=0,1", "--steps=2", "--timeout=0", "--out=o"], "--timeout: must be > 0 seconds"),
    # Writable by the permission bits for root (any path is), and still not a place for a directory.
    (sweep, [TINY, "--grid=seed=0,1", "--steps=2", "--out=/proc/ember_out"], "--out: cannot "),
    # Every run's config is validated before the first starts: a bad grid value or config is not a sweep of errors.
    (sweep, [TINY, "--grid=no_such=1,2", "--steps=2", "--out={tmp}"], "config.no_such: unknown config key (the run no_such=1)"),
    (sweep, [TINY, "--grid=model.num_heads=4,5", "--steps=2", "--out={tmp}"],
     "config.model.num_heads: 5 heads do not divide model.d_model=64 (or set model.head_dim) (the run model.num_heads=5)"),
    (sweep, ["--config=configs/nope.py", "--grid=seed=0,1", "--steps=2", "--out={tmp}"],
     "--config: no such config file: configs/nope.py"),
    (sweep, [TINY, "--grid=seed=0,1", "--steps=2", "--out={tmp}", "--config.data.path=/nonexistent/*.txt"],
     "config.data.path: no file matches '/nonexistent/*.txt'"),
    (sample, ["--prompt=x"], "--checkpoint: required, not given"),
    (sample, [f"--checkpoint={NOWHERE}", "--prompt=x", "--max_new_tokens=abc"], "--max_new_tokens: invalid int value"),
    (sample, [f"--checkpoint={NOWHERE}", "--prompt=x", "--top_p=high"], "--top_p: invalid float value: 'high'"),
    (sample, [f"--checkpoint={NOWHERE}", "--prompt=x", "--top_p=0.9"], "--top_p: 0.9 draws from the nucleus, but "
     "--temperature=0 (the default) takes the most likely token"),
    (export_hf, [f"--checkpoint={NOWHERE}"], "--out: required, not given"),
    (export_hf, [f"--checkpoint={NOWHERE}", f"--out={FILE}/hf"], f"--out: cannot create {FILE}/hf"),
    (export_hf, [f"--checkpoint={NOWHERE}", "--out=x", "--max_shard_size=0"],
     "--max_shard_size: '0' must be more than 0 bytes"),
    (bench, [TINY, f"--out={NOWHERE}/b.json"], f"--out: cannot write {NOWHERE}/b.json: no directory"),
    (bench, [TINY, "--steps=0"], "--steps: must be at least 1, got 0"),
    (bench, [TINY, "--warmup=two"], "--warmup: invalid int value: 'two'"),
    (bench, [TINY, "--quant_stats=maybe"], "--quant_stats: invalid boolean value: 'maybe'"),
    (bench, [TINY, "--stpes=3"], "--stpes=3: unknown command-line argument"),
    (precision_probe, [f"--checkpoint={NOWHERE}"], "--recipe: required, not given"),
    (precision_probe, [f"--checkpoint={NOWHERE}", "--recipe=fp8_delayed"], "--recipe: invalid choice: 'fp8_delayed'"),
    (precision_probe, [f"--checkpoint={NOWHERE}", "--recipe=nvfp4", "--batches=0"], "--batches: 0 must be at least 1"),
    (precision_probe, [f"--checkpoint={NOWHERE}", "--recipe=nvfp4"], f"--checkpoint: "),
    (cost_table, [], "REPORT.json: required, not given"),
    (cost_table, [f"{NOWHERE}/r.json"], f"{NOWHERE}/r.json: not a compile report"),
]


@pytest.mark.parametrize("tool,flags,expected", CASES,
                         ids=[f"{t.__name__.split('.')[-1]}:{e.split(':')[0]}" for t, _, e in CASES])
def test_bad_flag_is_one_line_and_exit_2(tool, flags, expected, tmp_path, capsys):
  flags = [f.replace("{tmp}", str(tmp_path / "out")) for f in flags]
  with pytest.raises(SystemExit) as exit_:
    tool.main(["tool", *flags])
  assert exit_.value.code == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), captured.err
  assert not captured.out


def test_help_still_prints_the_usage(capsys):
  with pytest.raises(SystemExit) as exit_:
    sample.main(["sample", "--help"])
  assert exit_.value.code == 0 and "--checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("tool,flags,expected", [
    (train_tokenizer, ["--out=t", "--vocab_size=abc"], "--vocab_size: invalid int value: 'abc'"),
    (write_array_record, [], "--out: required, not given"),
    (write_array_record, ["--out={tmp}", "--num_shards=0"], "--num_shards: must be >= 1, got 0"),
], ids=["train_tokenizer:--vocab_size", "write_array_record:--out", "write_array_record:--num_shards"])
def test_data_tools_bad_flag_is_one_line_and_exit_2(tool, flags, expected, tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    tool.main([f.replace("{tmp}", str(tmp_path / "out")) for f in flags])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.splitlines() == [f"error: {expected}"]
