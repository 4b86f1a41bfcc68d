"""The Dockerfile cannot be built here; check that it agrees with pyproject.toml and the repository."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _instructions() -> list[tuple[str, str]]:
  text = (ROOT / "Dockerfile").read_text()
  text = re.sub(r"\\\n", " ", text)  # Line continuations.
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line and not line.startswith("#"):
      op, _, rest = line.partition(" ")
      out.append((op.upper(), rest.strip()))
  return out


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pip_installs() -> list[list[str]]:
  runs = [shlex.split(rest) for op, rest in _instructions() if op == "RUN"]
  return [args[args.index("install") + 1:] for args in runs if "pip" in args and "install" in args]


def test_installs_the_project_with_its_gpu_extra():
  extras = _pyproject()["project"]["optional-dependencies"]
  targets = [a for args in _pip_installs() for a in args if not a.startswith("-")]
  project = [t for t in targets if re.fullmatch(r"\.(\[[\w,-]+\])?", t)]
  assert project, f"no `pip install .[...]` of the project in {targets}"
  named = {e for t in project for e in re.findall(r"[\w-]+", t)}
  assert "gpu" in named
  assert named <= set(extras), f"extras {named - set(extras)} are not in pyproject.toml"
  assert any(re.match(r"jax\[cuda\d+", dep) for dep in extras["gpu"])  # The extra brings CUDA JAX.
  assert len(targets) == len(project), f"installs outside pyproject.toml: {set(targets) - set(project)}"


def test_the_python_of_the_base_image_satisfies_requires_python():
  base = next(rest for op, rest in _instructions() if op == "FROM")
  version = re.search(r"python:(\d+)\.(\d+)", base)
  assert version, base
  minimum = re.fullmatch(r">=\s*(\d+)\.(\d+)", _pyproject()["project"]["requires-python"])
  assert tuple(map(int, version.groups())) >= tuple(map(int, minimum.groups()))


def test_what_the_install_needs_is_copied_before_it():
  ops = _instructions()
  first_install = next(i for i, (op, rest) in enumerate(ops) if op == "RUN" and "pip install" in rest)
  copied = {p for op, rest in ops[:first_install] if op == "COPY" for p in shlex.split(rest)[:-1]}
  assert {"pyproject.toml", "ember"} <= copied
  readme = _pyproject()["project"].get("readme")
  assert readme is None or readme in copied


def test_entry_point_is_train_py_and_everything_it_imports_is_in_the_image():
  ops = _instructions()
  entry = json.loads(next(rest for op, rest in ops if op == "ENTRYPOINT"))
  assert entry[0].startswith("python") and entry[1] == "train.py"
  assert (ROOT / entry[1]).is_file()
  copied = {p.rstrip("/") for op, rest in ops if op == "COPY" for p in shlex.split(rest)[:-1]}
  for needed in ("train.py", "configs", "ember", "launch"):  # train.py imports configs/; jobset uses launch/.
    assert needed in copied or "." in copied, needed
    assert (ROOT / needed).exists()
  workdir = next(rest for op, rest in ops if op == "WORKDIR")
  assert workdir.startswith("/")


def test_workdir_volume_and_default_command():
  ops = _instructions()
  volumes = [v for op, rest in ops if op == "VOLUME" for v in shlex.split(rest.strip("[]").replace(",", " "))]
  assert volumes, "no VOLUME"
  cmd = json.loads(next(rest for op, rest in ops if op == "CMD"))
  config = next(a for a in cmd if a.startswith("--config="))
  assert (ROOT / config.split("=", 1)[1].split(":")[0]).is_file()
  workdir = next(a for a in cmd if a.startswith("--config.workdir="))
  assert any(workdir.split("=", 1)[1].startswith(v.strip('"')) for v in volumes)


def test_dockerignore_keeps_runs_and_git_out_of_the_build_context():
  ignored = (ROOT / ".dockerignore").read_text().split()
  assert {".git", "runs"} <= set(ignored)
