"""The package's structure: no import cycles, floors imported in order, no private names across modules,
one recipe table. Read off the source with `ast`, top-level and function-level imports alike."""

import ast
import pathlib
import re

import pytest

from ember.quant.formats import hlo_type
from ember.quant.recipe import GEMM_PRECISIONS, RECIPES

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ember"

# Each floor imports only itself and the floors below it (see ember/__init__.py).
FLOORS = [
    ("ember", "ember.errors", "ember.keys", "ember.names", "ember.xla_flags", "ember.native_output", "ember.hardware",
     "ember.platform", "ember.storage"),
    ("ember.remat",),
    ("ember.quant",),
    ("ember.program",),
    ("ember.parallel",),
    ("ember.config",),
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


RECIPE_NAMES = RECIPES
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


# The modules that may spell a recipe or a GEMM precision: the recipe table, the quantizers and the kernels.
RECIPE_SPELLERS = ("ember.quant.recipe", "ember.quant.quantizers", "ember.quant.fused", "ember.quant.fused_nvfp4",
                   "ember.quant.kernels")


def _recipe_spellings(source: str) -> list[tuple[int, str]]:
  """(line, literal) of each string literal, docstrings aside, that is a recipe or GEMM precision name, or that
  names a recipe in its text; a dtype's spelling in prose ("emulated in bf16") is not a recipe."""
  names = set(RECIPES) | set(GEMM_PRECISIONS)
  in_prose = names - {hlo_type(d) for d in ("bfloat16", "float32")}
  tree = ast.parse(source)
  docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
  return [(n.lineno, n.value) for n in ast.walk(tree)
          if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
          and (n.value in names or set(re.findall(r"[a-z0-9_]+", n.value)) & in_prose)]


def test_only_the_recipe_table_quantizers_and_kernels_spell_a_recipe():
  """Adding a recipe touches the table, its quantizer and its kernels: every other module asks the table
  (ember/quant/recipe.py: names, precisions, bytes per element, the HLO element types of its data)."""
  offenders = [f"{MODULES[m].relative_to(ROOT)}:{line}: {text!r}" for m in MODULES if m not in RECIPE_SPELLERS
               for line, text in _recipe_spellings(MODULES[m].read_text())]
  assert not offenders, "\n".join(offenders)


def test_only_the_config_package_reads_config_trees():
  """ml_collections is imported by ember/config/ alone, and no function outside it takes a ConfigDict: every
  parameter that carries the config (`cfg`, `settings`) is annotated with the typed `Settings`."""
  importers, untyped = [], []
  for module, path in MODULES.items():
    if module.startswith("ember.config"):
      continue
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      importers += [f"{module}: imports {n}" for n in names if n.split(".")[0] == "ml_collections"]
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
          annotation = ast.unparse(a.annotation) if a.annotation else None
          if "ConfigDict" in (annotation or "") or (a.arg in ("cfg", "settings") and annotation != "Settings"):
            untyped.append(f"{module}.{node.name}({a.arg}: {annotation})")
  assert not importers and not untyped, "\n".join(importers + untyped)


def test_the_checker_sees_what_it_must():
  """The walkers above find function-level imports, upward imports and comparisons (a self-check)."""
  assert "ember.trainer.step" in GRAPH["ember.trainer.phase"]
  assert _COMPARISON.search('if recipe.name == "nvfp4":') and _COMPARISON.search("x in ('mxfp8', 'nvfp4')")
  assert not _COMPARISON.search('recipe = "nvfp4"')
  spelled = 'def f(r):\n  """Runs nvfp4."""\n  return {"bf16": 2, "x": "the mxfp8 GEMM", "y": "emulated in bf16"}\n'
  assert [text for _, text in _recipe_spellings(spelled)] == ["bf16", "the mxfp8 GEMM"]
  src = "def f():\n  from ember.plan import auto_remat\n"
  tree = ast.parse(src)
  assert any(isinstance(n, ast.ImportFrom) and n.module == "ember.plan" for n in ast.walk(tree))
