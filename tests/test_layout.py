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
    preflight, demo, folds                      end-to-end checks, the demo pipeline and its k-fold study
    cli, __main__                               the commands

Imports sit at the top of their module. One inside a function (or method, or class body) is
allowed only when it defers something heavy: a module of HEAVY (torch, megatron-core, MLflow and
the other slow or optional packages named there), or a module of ours whose module-level imports
reach one, transitively (those under ``if TYPE_CHECKING:`` do not run and do not count). That
keeps ``genome-lm --help`` and the planner's and data preparation's imports free of torch; a light
import moved to the top can make no module heavy, by that definition.
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
    {"genome_lm", "errors", "units", "progress", "digest", "config", "tracking", "weights", "measure", "mlflow_store",
     "records"},
    {"data", "engine"},
    {"model"},
    {"checkpoint"},
    {"train"},
    {"eval", "plan", "compare"},
    {"variants"},
    {"preflight", "demo", "folds"},
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


# What an import inside a function may defer: a module of these (or of a dotted entry's submodules),
# or a module of ours whose module-level imports reach one (heavy_modules). Anything else is imported
# at the top of its module. Times: `python -X importtime -c "import X"`, cumulative, on the 2-core CPU box.
HEAVY = {
    "torch": "2.7 s",
    "megatron": "megatron.core: 5.5 s, torch included",
    "triton": "0.3 s; its kernels run on a GPU only",
    "transformers": "0.8 s; a test oracle (the dev extra), not a dependency",
    "matplotlib": "0.2 s; the plots only",
    "mlflow": "1.8 s; tracking only, and never on ranks other than 0",
    "ray": "0.3 s; the parallel workers only",
    "pydantic": "0.03 s, with genome_lm.config's models on it 0.14 s: a third of `genome-lm --help`",
    "pandas": "0.3 s; not a dependency (MLflow brings it)",
    "pysam": "0.02 s; htslib's binding, not built for every platform (preflight runs without it)",
    "requests": "0.09 s; not a dependency (MLflow's HTTP client, loaded once MLflow is)",
    "recall_bench": "1.3 s; optional (the dev extra)",
    "safetensors.torch": "imports torch (safetensors itself takes 3 ms)",
    "transformer_engine": "GPU-only, optional (the gpu extra)",
    "fla": "GPU-only, optional (the gpu extra)",
    "vllm": "GPU-only, optional",
}
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """(import statement, inside a function, inside a function or class) for each import that runs:
    none under ``if TYPE_CHECKING:``."""
    found = []

    def walk(node, in_function, nested):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function, nested))
            elif _is_type_checking(child):
                for stmt in child.orelse:
                    walk(ast.Module(body=[stmt]), in_function, nested)
            else:
                walk(child, in_function or isinstance(child, _FUNCTIONS),
                     nested or isinstance(child, (*_FUNCTIONS, ast.ClassDef)))

    walk(tree, False, False)
    return found


def _named(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The modules an import statement may load: ``import a.b`` -> a.b; ``from a import b`` -> a and a.b
    (b may be a module); relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = (module if is_package else module.rpartition(".")[0]).split(".")
        base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _loads_heavy(name: str, ours_heavy: set[str]) -> bool:
    """Whether importing ``name`` loads a HEAVY module, or a module of ours in ``ours_heavy`` (a parent
    package runs first: genome_lm.a.b loads genome_lm.a)."""
    return any(p in HEAVY or p in ours_heavy for p in _prefixes(name))


def _sources() -> dict[str, tuple[str, bool]]:
    """module -> (its source, whether it is a package) for genome_lm and genome_lm_kernels."""
    paths = {**_modules("genome_lm"), **_modules("genome_lm_kernels")}
    return {name: (path.read_text(), path.name == "__init__.py") for name, path in paths.items()}


def heavy_modules(sources: dict[str, tuple[str, bool]]) -> set[str]:
    """The modules of ``sources`` (module -> source, is a package) whose module-level imports reach a
    HEAVY module, transitively; a module's parent packages count as its imports (they run first)."""
    loads = {}
    for name, (source, is_package) in sources.items():
        runs = [node for node, in_function, _ in _imports(ast.parse(source)) if not in_function]  # class bodies run
        loads[name] = {n for node in runs for n in _named(node, name, is_package)} | set(_prefixes(name)[:-1])
    heavy, grew = set(), True
    while grew:
        grew = False
        for name, targets in loads.items():
            if name not in heavy and any(_loads_heavy(t, heavy) for t in targets):
                heavy.add(name)
                grew = True
    return heavy


def light_deferred_imports(source: str, module: str, heavy: set[str], is_package: bool = False) -> list[str]:
    """``line imports X`` for each import inside a function (or class) of ``source`` that loads
    nothing heavy (``heavy``: our heavy modules, from heavy_modules)."""
    found = []
    for node, _, nested in _imports(ast.parse(source)):
        if not nested:
            continue
        named = _named(node, module, is_package)
        if not any(_loads_heavy(n, heavy) for n in named):
            what = ", ".join(named) if isinstance(node, ast.Import) else named[0]
            found.append(f"{node.lineno} imports {what}")
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


def test_imports_inside_functions_load_something_heavy():
    """An import inside a function defers a heavy module (HEAVY, or ours that reaches one); a light
    one sits at the top of its module, where a reader sees what the module needs."""
    sources = _sources()
    heavy = heavy_modules(sources)
    paths = {**_modules("genome_lm"), **_modules("genome_lm_kernels")}
    light = [f"{paths[name].relative_to(ROOT)}:{found} (not heavy: move it to the top)"
             for name, (source, is_package) in sorted(sources.items())
             for found in light_deferred_imports(source, name, heavy, is_package)]
    assert light == [], "\n" + "\n".join(light)


def test_the_deferred_import_check_finds_a_light_import():
    sources = {
        "pkg": ("", True),
        "pkg.light": ("import json\nfrom . import units\n", False),
        "pkg.units": ("def f():\n    import torch\n", False),
        "pkg.model": ("import os\nfrom pkg.light import x\nfrom .layer import y\n", False),
        "pkg.layer": ("import numpy\nfrom megatron.core import parallel_state\n", False),
        "pkg.typed": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", False),
        "pkg.big": ("import safetensors.torch\n", True),
        "pkg.big.small": ("", False),
    }
    heavy = heavy_modules(sources)
    assert heavy == {"pkg.model", "pkg.layer", "pkg.big", "pkg.big.small"}
    source = ("import os\n\n"
              "def f():\n    import json\n    from pkg.light import x\n    from . import typed, units\n\n"
              "def g():\n    import torch.nn\n    from safetensors.torch import save_file\n"
              "    from .model import build\n"
              "    from pkg import light, model\n    from pkg.big.small import z\n\n"
              "class C:\n    def m(self):\n        from safetensors import safe_open\n")
    assert light_deferred_imports(source, "pkg.here", heavy) == [
        "4 imports json", "5 imports pkg.light", "6 imports pkg", "17 imports safetensors"]


def test_our_heavy_modules_are_the_model_not_the_commands():
    heavy = heavy_modules(_sources())
    assert {"genome_lm.model.model", "genome_lm.train.trainer"} <= heavy
    assert not heavy & {"genome_lm", "genome_lm.cli", "genome_lm.plan", "genome_lm.data", "genome_lm.units"}


@pytest.mark.parametrize("command", [["--help"], ["finetune", "--help"]])
def test_help_imports_no_torch(command):
    """--help stays fast: the commands import torch, megatron-core, MLflow (HEAVY) only when they run."""
    names = sorted(name for name in HEAVY if "." not in name
                   and not (name == "pydantic" and command != ["--help"]))  # typer's, for a command's options
    code = ("import sys\nfrom genome_lm.cli import app\n"
            f"try:\n    app({command!r})\nexcept SystemExit:\n    pass\n"
            f"heavy = sorted(m for m in {names!r} if m in sys.modules)\n"
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
