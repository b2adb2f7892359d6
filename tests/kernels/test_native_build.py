"""The C kernels are built at install (``kernels/genome_lm_kernels/cpu/build.py`` through
setup.py): this install has them (a failure here, not a skip, when it does not), the module in
use is the highest instruction-set level this CPU runs, the backend resolution decides whether
they run, and the interface is compiler-checked: a definition that drifts from ``kernels.h``
does not build."""

import importlib
import re
import shutil
from pathlib import Path

import pytest

from genome_lm_kernels import resolve_backend

native = importlib.import_module("genome_lm_kernels.cpu.native")
build = importlib.import_module("genome_lm_kernels.cpu.build")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_this_install_has_the_c_kernels_for_this_cpu():
    assert native.available(), native.NOT_BUILT
    flags = _cpu_flags()
    if not build.X86 or not flags:
        assert native.level() == "base"
    elif {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        assert native.level() == "v4"
    elif {"avx2", "fma", "bmi2", "f16c", "movbe"} <= flags:
        assert native.level() == "v3"
    else:
        assert native.level() == "base"
    lib = native.library()
    declared = {line.split("(")[0].split()[-1].lstrip("*") for line in build.declarations().splitlines() if "(" in line}
    assert declared == {n for n in dir(lib) if n.startswith(("dsa_", "kda_", "mhc_", "genome_lm_"))}


def test_the_backend_resolution_decides_whether_c_runs(monkeypatch):
    assert resolve_backend("torch", "cpu").native
    assert not resolve_backend("torch", "cpu", native=False).native
    assert not resolve_backend("reference", "cpu").native  # the reference is the reference everywhere
    with pytest.raises(ValueError, match="torch backend on a CPU only"):
        resolve_backend("reference", "cpu", native=True)
    monkeypatch.setenv("GENOME_LM_NATIVE", "0")
    assert not resolve_backend("torch", "cpu").native
    monkeypatch.delenv("GENOME_LM_NATIVE")
    monkeypatch.setattr(native, "_module", lambda: None)  # an install without them
    assert not resolve_backend("torch", "cpu").native
    with pytest.raises(RuntimeError, match="not built in this install"):
        resolve_backend("torch", "cpu", native=True)
    with pytest.raises(RuntimeError, match="pip install -e"):
        native.library("dsa")


def test_a_build_from_other_sources_is_not_used(monkeypatch):
    """After a source changes without a reinstall the built modules no longer match it: they are
    not used (a warning says to reinstall), so the C and Python sides cannot disagree."""
    monkeypatch.setattr(build, "source_hash", lambda source_dir=None: "0123456789abcdef")
    native._module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="built from other sources"):
            assert not native.available()
        assert not resolve_backend("torch", "cpu").native
    finally:
        monkeypatch.undo()
        native._module.cache_clear()
    assert native.available()


@pytest.mark.slow  # two builds of the three sources, about 10 s on 2 cores
@pytest.mark.parametrize("where", ["definition", "declaration"])
def test_a_signature_that_drifts_from_kernels_h_does_not_build(tmp_path, capfd, where):
    """The unchanged sources build from a copy; with one parameter's type changed in a
    definition (dsa.c) or in its declaration (kernels.h) the build fails and names it."""
    from cffi import VerificationError

    here = Path(build.__file__).parent
    for name in ("good", "bad"):
        shutil.copytree(here, tmp_path / name, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.py"))
    old = "int dsa_select_tokens(const float *qi, const float *kpT, const float *w, int64_t r0, int64_t r1, int64_t T,"
    new = old.replace("int64_t r1", "int32_t r1")
    target = tmp_path / "bad" / ("dsa.c" if where == "definition" else "kernels.h")
    text = target.read_text()
    assert text.count(old) == 1
    target.write_text(text.replace(old, new))
    built = build.builder("base", tmp_path / "good").compile(tmpdir=str(tmp_path / "out-good"))
    assert Path(built).exists()
    capfd.readouterr()
    with pytest.raises(VerificationError, match="bad/dsa.c"):
        build.builder("base", tmp_path / "bad").compile(tmpdir=str(tmp_path / "out-bad"))
    assert re.search(r"conflicting types for .dsa_select_tokens", capfd.readouterr().err)
