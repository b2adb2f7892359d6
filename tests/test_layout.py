"""The package's import graph: no cycles, and every package imports only the layers below it.

Read from the source (every ``import``, including those inside functions), so an import that
only runs on a GPU or in one command still counts. The layers, lowest first:

    errors, units, progress, digest, config,    plain helpers; the weights shipped with the package
    tracking, weights
    data, engine                                datasets; process groups and the CPU/GPU backend
    model                                       the model on megatron-core
    checkpoint                                  checkpoints (training, Hugging Face) and what a path names
    train                                       the trainer, its optimizer and launcher
    eval, plan, compare                         evaluation; the hardware planner; parity and speed
                                                against transformers
    variants                                    variant effects (scores with eval's models)
    preflight, demo                             end-to-end checks and the demo pipeline
    cli, __main__                               the commands
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    {"genome_lm", "errors", "units", "progress", "digest", "config", "tracking", "weights", "measure", "mlflow_store"},
    {"data", "engine"},
    {"model"},
    {"checkpoint"},
    {"train"},
    {"eval", "plan", "compare"},
    {"variants"},
    {"preflight", "demo"},
    {"cli", "__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules(package: str) -> dict[str, Path]:
    """module name -> file of ``package`` (genome_lm at the root, genome_lm_kernels under kernels/)."""
    base = ROOT / "kernels" if package == "genome_lm_kernels" else ROOT
    found = {}
    for path in (base / package).rglob("*.py"):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(package: str = "genome_lm") -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (``from a import b`` counts a.b when b is a module)."""
    modules = _modules(package)
    edges = defaultdict(set)
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_packages():
    packages = defaultdict(set)
    for a, targets in import_graph().items():
        packages[_top(a)].update(_top(b) for b in targets if _top(b) != _top(a))
    assert cycles(packages) == []


def test_every_package_has_a_layer():
    tops = {_top(m) for m in _modules("genome_lm")}
    assert tops <= set(LAYER), f"place {sorted(tops - set(LAYER))} in LAYERS"


def test_packages_import_only_lower_layers():
    upward = sorted(f"{a} imports {b}" for a, targets in import_graph().items() for b in targets
                    if LAYER[_top(b)] > LAYER[_top(a)])
    assert upward == []


def test_kernels_import_nothing_of_genome_lm():
    assert _modules("genome_lm_kernels"), "no kernel sources found under kernels/"
    reaching = []
    for name, path in _modules("genome_lm_kernels").items():
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            reaching += [f"{name}: {n}" for n in names if n == "genome_lm" or n.startswith("genome_lm.")]
    assert reaching == []


@pytest.mark.parametrize("command", [["--help"], ["finetune", "--help"]])
def test_help_imports_no_torch(command):
    """--help stays fast: the commands import torch, megatron-core and mlflow only when they run."""
    code = ("import sys\nfrom genome_lm.cli import app\n"
            f"try:\n    app({command!r})\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'megatron', 'mlflow', 'ray', 'matplotlib') if m in sys.modules)\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_training_functions_read_in_one_screen():
    """No function in genome_lm/train is longer than 60 lines (the trainer's step reads in one screen)."""
    long = []
    for path in sorted((ROOT / "genome_lm" / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_one_default_per_setting():
    """The mostly-N threshold and the study's window each have one home (genome_lm.data.windows);
    the config schema (a lower layer) repeats the threshold, held equal here."""
    from genome_lm.config import DataConfig
    from genome_lm.data.prepare import PrepareRequest
    from genome_lm.data.windows import MAX_N_FRACTION, STUDY_WINDOW
    from genome_lm.eval.evaluate import EvalRequest

    assert DataConfig.model_fields["max_n_fraction"].default == MAX_N_FRACTION
    assert EvalRequest(model="m", out=Path("o")).max_n_fraction == MAX_N_FRACTION
    assert EvalRequest(model="m", out=Path("o")).window == STUDY_WINDOW
    assert PrepareRequest(Path("g.fa"), Path("o")).windows.window == STUDY_WINDOW


def test_the_kernels_folder_is_not_a_package_named_kernels():
    """The kernels' source sits under kernels/ (imported as genome_lm_kernels); the folder itself
    must not shadow the PyPI package ``kernels`` that transformers imports: ``import kernels``
    from the repository root finds the installed one, or nothing, never the folder."""
    from importlib import metadata

    assert not (ROOT / "kernels" / "__init__.py").exists()
    code = ("import importlib.util as u, json; s = u.find_spec('kernels'); "
            "print(json.dumps(s and [s.origin, list(s.submodule_search_locations or [])]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("the PyPI package kernels is not installed here: nothing to shadow")
    origin, locations = json.loads(out.stdout)
    assert origin is not None, f"`import kernels` finds a namespace package at {locations}, not PyPI's kernels"
    assert ROOT / "kernels" not in [Path(p).resolve() for p in locations], locations
    import genome_lm_kernels

    assert Path(genome_lm_kernels.__file__).resolve().parent == ROOT / "kernels" / "genome_lm_kernels"


def test_tests_mirror_the_package():
    """Each folder of tests/ is a package folder's (genome_lm/X, or kernels for genome_lm_kernels),
    and the tests of a module sit in its package's folder: no genome_lm package without one."""
    packages = {p.name for p in (ROOT / "genome_lm").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= packages | {"kernels"}, folders - packages - {"kernels"}
    untested = {name for name in packages - folders if any((ROOT / "genome_lm" / name).glob("[!_]*.py"))}
    assert untested <= {"cli"}, untested  # the commands: tests/test_cli.py and each package's own tests
