"""Every command README.md and docs/ show still parses as written: its config file and preset load, each
`--config.KEY=VALUE` names a key of the right kind, each tool flag is one the tool takes, each extra is one
pyproject.toml declares. Nothing is run: a documented command whose flags were renamed or removed fails here.

Commands are found in fenced and indented code and in inline code: `python train.py ...`, `python -m
ember.tools.NAME ...`, `sbatch ... launch/slurm.sbatch ...` (whose arguments are train.py's), `pip install -e
".[EXTRAS]"`. Placeholders stay as they are (a flag's value is not read), `[--flag=a|b]` counts as `--flag=a`,
and an elided command (`--config=...`, or `...` where its config would be) or a bare `python train.py` named in
prose is skipped."""

import contextlib
import functools
import importlib
import io
import pathlib
import re
import shlex
import tomllib

import pytest

from ember import config as config_lib
from ember.config import schema as config_schema

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"(?:python train\.py|python -m ember\.tools\.\w+|sbatch [^`\n]*?launch/slurm\.sbatch"
                      r"|pip install -e [^`\s]+)[^`\n]*")


def documented_commands() -> list[tuple[str, str]]:
  """(where, command) for each command in the docs, continuation lines joined."""
  out = []
  for path in DOCS:
    lines = path.read_text().splitlines()
    first = 0
    while first < len(lines):
      last = first
      while lines[last].endswith("\\") and last + 1 < len(lines):
        last += 1
      text = " ".join(line.removesuffix("\\").strip() for line in lines[first:last + 1])
      for match in (m for part in re.split(r"\s(?:&&|;|\|\|)\s", text) for m in _COMMAND.finditer(part)):
        command = re.sub(r"\[(--[^\]]*)\]", r"\1", match.group(0)).strip()
        out.append((f"{path.relative_to(ROOT)}:{first + 1}", command))
      first = last + 1
  return out


COMMANDS = documented_commands()


def _tokens(command: str) -> list[str]:
  try:
    tokens = shlex.split(command)
  except ValueError:  # An inline quote cut by the end of the code span: split on spaces.
    tokens = command.split()
  return [t.split("|")[0] if t.startswith("--") else t for t in tokens]


def _placeholder(value: str) -> bool:
  """A value the reader fills in: RECIPE, R, $model, ..."""
  return bool(re.fullmatch(r"\$\w+|[A-Z][A-Z0-9_]*|.*\.\.\..*", value))


def _check_config(flags: list[str]) -> None:
  """The config flags load (the file, its preset, each key) and every value has its key's kind and choices; a
  placeholder value is left out, its key still checked, and `--config.KEY=VALUE` itself stands for any key."""
  given = []
  for flag in (f for f in flags if f.startswith("--config")):
    name, _, value = flag.partition("=")
    if name == "--config" and ":" in value and _placeholder(value.split(":", 1)[1]):
      flag = f"--config={value.split(':', 1)[0]}"
    elif name.startswith("--config.") and _placeholder(value):
      key = name.removeprefix("--config.")
      assert key == "KEY" or config_schema.is_key(key), f"{key}: not a config key"
      continue
    given.append(flag)
  cfg = config_lib.load(["train.py", *given])
  config_schema.check(cfg)


@functools.cache
def tool_flags(module: str) -> frozenset[str]:
  """The flags `python -m MODULE` takes, read from its --help."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
    importlib.import_module(module).main([f"python -m {module}", "--help"])
  return frozenset(re.findall(r"(--[a-z_][a-z0-9_-]*)", out.getvalue()))


@pytest.mark.parametrize("where,command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_parses(where, command, monkeypatch):
  monkeypatch.chdir(ROOT)  # Commands run from the repository, as the README says.
  tokens = _tokens(command)
  if "--config=..." in tokens or "..." in tokens and not any(t.startswith("--config=") for t in tokens):
    return  # Elided: the point shown is not the command.
  if tokens == ["python", "train.py"]:
    return  # Named in prose.
  if tokens[:3] == ["pip", "install", "-e"]:
    extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", tokens[3])
    assert extras, f"{where}: {tokens[3]!r} is not an install of this project"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in filter(None, (extras.group(1) or "").split(",")):
      assert extra in declared, f"{where}: no extra {extra!r} in pyproject.toml"
    return
  if tokens[0] == "sbatch":
    script = tokens.index("launch/slurm.sbatch")
    assert (ROOT / tokens[script]).is_file()
    _check_config(tokens[script + 1:])
    return
  if tokens[:2] == ["python", "train.py"]:
    assert not [t for t in tokens[2:] if t.startswith("--") and not t.startswith("--config") and t != "--help"], where
    if tokens[2:] == ["--help"]:
      return
    _check_config(tokens[2:])
    return
  module = tokens[2]
  flags = [t for t in tokens[3:] if t.startswith("--")]
  own = {f.split("=")[0] for f in flags if not f.startswith("--config")}
  assert own <= tool_flags(module), f"{where}: {module} takes no {sorted(own - tool_flags(module))}"
  if any(f.startswith("--config") for f in flags):
    _check_config(flags)


def test_the_docs_show_commands():
  """The extraction finds them: a change of the docs' style must not silently leave this test with nothing."""
  kinds = {re.match(r"python train\.py|python -m ember\.tools\.\w+|sbatch|pip", c).group(0) for _, c in COMMANDS}
  assert len(COMMANDS) >= 40 and {"python train.py", "sbatch", "pip", "python -m ember.tools.compile",
                                   "python -m ember.tools.plan", "python -m ember.tools.sweep"} <= kinds
