"""No import runs up the layers: the import graph of infer/, read with `ast` (module-level and function-level
imports alike, relative and absolute, and importlib.import_module with a literal "infer.x" name).

A subpackage may import only from subpackages on a lower layer (never from one on its own layer but another
name, nor from one above). `infer/__init__.py` (the public API) may import anything; a submodule may read the
constants `infer/__init__.py` defines itself (e.g. `__version__`), which Python has loaded before any submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "infer"

# Lowest first. Each entry is one layer: a set of subpackages (top-level modules count as subpackages).
LAYERS: list[set[str]] = [
    {"errors"},
    {"checks"},     # input checks every layer applies alike (valid Unicode text, sizes in bytes)
    {"kernels"},    # Triton ops and their torch references (incl. GPTQ unpack/dequantize)
    {"quant"},      # GPTQ config, packing, GPTQLinear, quantize/convert drivers
    {"models"},     # decoders, loader (builds GPTQLinear modules), model resolution, built-in tiny models
    {"lora"},       # adapters, slots, LoRA layers over the models' linears
    {"memory"},     # memory plan: byte formulas, checkpoint estimate, budget and KV blocks, peak meters
    {"engine"},     # scheduler, block manager, runner, sampler, profile run, LLMEngine
    {"serve"},      # OpenAI-compatible app over an engine
    {"parallel"},   # Ray replicas of the engine; the data-parallel server reuses serve's app
    {"bench"},      # benchmarks drive engines, servers and replica pools
    {"cli"},        # commands: everything
    {"__main__"},   # `python -m infer`: the console script
]

# (importing subpackage, imported subpackage) -> why this upward edge is tolerated for now. Each entry must still
# be needed: a stale entry fails the test, so removing the edge means removing its entry.
ALLOWED: dict[tuple[str, str], str] = {}  # (lower, upper) -> why; empty: no import runs up the layers


def _layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _root_constants() -> set[str]:
    """Names infer/__init__.py binds by plain assignment (not the lazy re-exports of its __getattr__)."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    return {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}


def _module_name(path: Path) -> tuple[str, str]:
    """('infer.engine.llm', 'infer.engine') for infer/engine/llm.py: the module and the package it sits in."""
    parts = ("infer",) + path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _targets(node: ast.AST, package: str, constants: set[str]) -> list[str]:
    """The infer modules one import statement (or import_module call) loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "infer"]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module.split(".")[0] != "infer":
            return []
        if module == "infer":  # `from .. import x`: a subpackage, or one of the root's own constants
            return ["infer" if a.name in constants else f"infer.{a.name}" for a in node.names]
        return [module]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            arg = arg.values[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("infer."):
            return [arg.value.rstrip(".")]
    return []


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(from subpackage, to subpackage) -> ['infer/x/y.py:LINE imports infer.z...'] for every cross-subpackage
    import. Imports of the root's own constants are left out (see the module docstring)."""
    constants, edges = _root_constants(), {}
    for path in sorted(ROOT.rglob("*.py")):
        module, package = _module_name(path)
        src = module.split(".")[1] if "." in module else "__init__"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, constants):
                if target == "infer":
                    continue
                dst = target.split(".")[1]
                if dst != src:
                    where = f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {target}"
                    edges.setdefault((src, dst), []).append(where)
    return edges


def test_every_subpackage_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert names == set(_layer_of()), "give every subpackage a layer in LAYERS"


def test_no_import_runs_up_the_layers():
    layer = _layer_of()
    edges = import_edges()
    assert edges, "the import graph is empty: the parser is broken"
    bad = {edge: where for edge, where in edges.items()
           if edge[0] != "__init__" and layer[edge[1]] >= layer[edge[0]] and edge not in ALLOWED}
    assert not bad, "imports that run up (or across) the layers:\n" + "\n".join(
        f"  {a} -> {b}:\n    " + "\n    ".join(w) for (a, b), w in sorted(bad.items()))


def test_allow_list_is_not_stale():
    edges = import_edges()
    stale = [edge for edge in ALLOWED if edge not in edges]
    assert not stale, f"these allowed upward imports are gone; remove them from ALLOWED: {stale}"


def test_the_parser_sees_function_level_and_relative_imports(tmp_path):
    src = "def f():\n    from ..engine.llm import LLM\n    from .. import __version__, kernels\n"
    tree = ast.parse(src)
    found = [t for n in ast.walk(tree) for t in _targets(n, "infer.lora", {"__version__"})]
    assert found == ["infer.engine.llm", "infer", "infer.kernels"]
