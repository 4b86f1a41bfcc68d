"""The package's structure: no import cycles, floors imported in order, no private names across modules,
one recipe table. Read off the source with `ast`, top-level and function-level imports alike."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ember"

# Each floor imports only itself and the floors below it (see ember/__init__.py).
FLOORS = [
    ("ember", "ember.errors", "ember.keys", "ember.names", "ember.xla_flags", "ember.native_output", "ember.hardware",
     "ember.platform", "ember.storage"),
    ("ember.remat",),
    ("ember.quant",),
    ("ember.parallel",),
    ("ember.model_config", "ember.config_phases", "ember.settings", "ember.config_schema", "ember.config"),
    ("ember.layers", "ember.data", "ember.hf"),
    ("ember.trainer", "ember.inference"),
    ("ember.plan",),
    ("ember.tools",),
]


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
  """The ember module an import refers to (`ember.quant.dot.quantized_matmul` -> `ember.quant.dot`)."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(module: str) -> list[tuple[str, str | None]]:
  """(imported ember module, imported name or None) for every import statement, at any depth."""
  tree = ast.parse(MODULES[module].read_text())
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [(_resolve(a.name), None) for a in node.names if a.name.split(".")[0] == "ember"]
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ember":
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in MODULES:  # `from ember.quant import dot`: a module.
          out.append((full, None))
        else:
          out.append((_resolve(node.module), a.name))
  return [(m, n) for m, n in out if m is not None]


GRAPH = {m: {dep for dep, _ in _imports(m)} - {m} for m in MODULES}


def _floor(module: str) -> int:
  best = None
  for i, floor in enumerate(FLOORS):
    for prefix in floor:
      if module == prefix or (prefix != "ember" and module.startswith(prefix + ".")):
        best = i
  assert best is not None, f"{module} belongs to no floor"
  return best


def test_no_import_cycles():
  state: dict[str, int] = {}  # 1 = on the stack, 2 = done.

  def visit(m, stack):
    state[m] = 1
    for dep in sorted(GRAPH[m]):
      if state.get(dep) == 1:
        cycle = stack[stack.index(dep):] + [dep]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if dep not in state:
        visit(dep, stack + [dep])
    state[m] = 2

  for m in sorted(MODULES):
    if m not in state:
      visit(m, [m])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_floors_import_downwards(module):
  """A package-level view: e.g. trainer/ imports nothing from plan/ or tools/, quant/ nothing above it."""
  mine = _floor(module)
  upward = sorted(d for d in GRAPH[module] if d != "ember" and _floor(d) > mine)
  assert not upward, f"{module} (floor {mine}) imports {upward}"


def test_trainer_imports_nothing_from_tools_or_plan():
  for m in MODULES:
    if m.startswith("ember.trainer"):
      assert not [d for d in GRAPH[m] if d.startswith(("ember.tools", "ember.plan"))], m


def test_no_private_names_across_modules():
  for module in MODULES:
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}  # Local names bound to other ember modules.
    for dep, name in _imports(module):
      assert not (name and name.startswith("_") and dep != module), f"{module} imports {dep}.{name}"
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ember"):
        for a in node.names:
          if f"{node.module}.{a.name}" in MODULES:
            aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
          and node.attr.startswith("_") and not node.attr.startswith("__")):
        pytest.fail(f"{module} uses {aliases[node.value.id]}.{node.attr}")


RECIPE_NAMES = ("bf16", "fp8_delayed", "fp8_current", "mxfp8", "nvfp4")
_COMPARISON = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](%s)["']|["'](%s)["']\s*(==|!=)""" % (
    "|".join(RECIPE_NAMES), "|".join(RECIPE_NAMES)))


def test_recipe_names_are_compared_only_in_the_recipe_table():
  offenders = []
  for module, path in MODULES.items():
    if module == "ember.quant.recipe":
      continue
    for n, line in enumerate(path.read_text().splitlines(), 1):
      if _COMPARISON.search(line.split("#")[0]):
        offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
  assert not offenders, "\n".join(offenders)


def test_the_checker_sees_what_it_must():
  """The walkers above find function-level imports, upward imports and comparisons (a self-check)."""
  assert "ember.trainer.step" in GRAPH["ember.trainer.loop"]
  assert _COMPARISON.search('if recipe.name == "nvfp4":') and _COMPARISON.search("x in ('mxfp8', 'nvfp4')")
  assert not _COMPARISON.search('recipe = "nvfp4"')
  src = "def f():\n  from ember.plan import auto_remat\n"
  tree = ast.parse(src)
  assert any(isinstance(n, ast.ImportFrom) and n.module == "ember.plan" for n in ast.walk(tree))
