"""Kernel sources: a kernel is keyed by its module and every project-local module it imports.

The end-to-end case is the real CLI and a real CuTe-DSL compile: a kernel module whose thread
count comes from a helper beside it. The rest reads module trees written here, with ``ast``
(nothing is imported), and a site directory with a real pip-written RECORD.
"""

from __future__ import annotations

import builtins
import json
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kernelcache import stamp as stamps
from kernelcache.errors import StampMismatchError, WarmError
from kernelcache.measure import file_digest
from kernelcache.sources import ABSENT, SourceError, module_sources
from kernelcache.store import Store
from kernelcache.toolchains.base import entry_point_sources
from tests.conftest import EXAMPLES, needs_cute, scaled, subprocess_env
from tests.conftest import run_kernelcache as kernelcache
from tests.helpers.wheels import build_wheel, pip_install

HELPER = "demo_threads"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Writes ``{relative path: text}`` under a fresh folder first on sys.path."""
    root = tmp_path / "modules"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def write(files: dict[str, str]) -> Path:
        return write_tree(root, files)

    return write


# --- the defect, end to end ---------------------------------------------------------------


@needs_cute
def test_a_changed_helper_module_is_a_new_generation_and_refused_in_serving(tmp_path):
    """Change only the helper a kernel module imports its thread count from: the build must
    not say up-to-date (its kernels trace to another IR), and a strict serving process must
    not load the kernels compiled with the old count, naming the helper as what moved."""
    demo = (EXAMPLES / "demo_kernels.py").read_text()
    assert "\nTHREADS = 128\n" in demo
    (tmp_path / "demo_kernels.py").write_text(
        demo.replace("\nTHREADS = 128\n", f"\nfrom {HELPER} import THREADS\n")
    )
    (tmp_path / f"{HELPER}.py").write_text("THREADS = 128\n")
    (tmp_path / "demo_serve.py").write_text((EXAMPLES / "demo_serve.py").read_text())
    workload = {"sizes": [[128, 256]], "dtypes": ["float16"], "tiles": [[32, 32]]}
    doc = yaml.safe_load((EXAMPLES / "kernelcache.yaml").read_text())
    doc["spec"]["warmers"][0]["workload"] = workload
    spec = tmp_path / "kc.yaml"
    spec.write_text(yaml.safe_dump(doc))
    store, key = tmp_path / "store", "default/demo/sm_90a"
    pythonpath = f"{tmp_path}:{subprocess_env()['PYTHONPATH']}"

    def build() -> subprocess.CompletedProcess[str]:
        proc = kernelcache("build", "-f", str(spec), "--store", str(store), "--arch", "sm_90a")
        assert proc.returncode == 0, proc.stderr
        return proc

    build()
    first = Store(store).current_manifest(key)
    assert first is not None

    (tmp_path / f"{HELPER}.py").write_text("THREADS = 64\n")

    served = subprocess.run(
        [sys.executable, str(tmp_path / "demo_serve.py"), "--workload", json.dumps(workload)],
        env=subprocess_env(
            PYTHONPATH=pythonpath,
            KERNELCACHE_CUTE_DSL_DIR=str(Store(store).current(key) / "files" / "cute-dsl"),
            KERNELCACHE_STRICT="1",
        ),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert served.returncode != 0, served.stdout
    assert "no kernel compiled from this IR" in served.stderr, served.stderr
    assert f"since its compile: module {HELPER}" in served.stderr
    assert "loaded from cache" not in served.stdout

    rebuilt = build()
    assert "published" in rebuilt.stdout, rebuilt.stdout
    second = Store(store).current_manifest(key)
    assert second is not None and second.generation != first.generation


# --- what the walk reaches ----------------------------------------------------------------


def test_helpers_one_two_and_three_modules_deep_are_keyed_each(tree):
    root = tree(
        {
            "kc_kern.py": "from kc_h1 import A\n",
            "kc_h1.py": "import kc_h2\nA = kc_h2.B\n",
            "kc_h2.py": "from kc_h3 import C as B\n",
            "kc_h3.py": "C = 1\n",
        }
    )
    modules = ("kc_h1", "kc_h2", "kc_h3", "kc_kern")
    found = module_sources("kc_kern")
    assert found == {m: file_digest(root / f"{m}.py") for m in modules}
    (root / "kc_h3.py").write_text("C = 2\n")
    assert module_sources("kc_kern") == {**found, "kc_h3": file_digest(root / "kc_h3.py")}


def test_package_relative_imports_init_and_submodules_named_in_from_imports(tree):
    tree(
        {
            "kc_pkg/__init__.py": "from .consts import V\n",
            "kc_pkg/consts.py": "V = 1\n",
            "kc_pkg/kernels/__init__.py": "",
            "kc_pkg/kernels/gemm.py": (
                "from .. import tiles\nfrom ..sub.deep import W\nfrom . import V\n"
            ),
            "kc_pkg/tiles.py": "T = 1\n",
            "kc_pkg/sub/__init__.py": "",
            "kc_pkg/sub/deep.py": "W = 1\n",
        }
    )
    assert set(module_sources("kc_pkg.kernels.gemm")) == {
        "kc_pkg",  # its __init__ runs first, and imports kc_pkg.consts
        "kc_pkg.consts",
        "kc_pkg.kernels",
        "kc_pkg.kernels.gemm",
        "kc_pkg.tiles",  # `from .. import tiles`: a submodule, not an attribute
        "kc_pkg.sub",
        "kc_pkg.sub.deep",
    }  # `from . import V` names an attribute of kc_pkg.kernels: no module of that name


def test_imports_inside_functions_and_by_literal_name_count(tree):
    tree(
        {
            "kc_kern.py": (
                "import importlib\n"
                "def build():\n"
                "    import kc_lazy\n"
                "    return importlib.import_module('kc_dynamic'), __import__('kc_dunder')\n"
            ),
            "kc_lazy.py": "",
            "kc_dynamic.py": "",
            "kc_dunder.py": "",
        }
    )
    assert set(module_sources("kc_kern")) == {"kc_kern", "kc_lazy", "kc_dynamic", "kc_dunder"}


def test_nothing_is_imported_or_run(tree):
    ran = "raise RuntimeError('ran')\n"
    tree({"kc_pkg/__init__.py": ran, "kc_pkg/kern.py": ran})
    assert set(module_sources("kc_pkg.kern")) == {"kc_pkg", "kc_pkg.kern"}
    assert "kc_pkg" not in sys.modules and "kc_pkg.kern" not in sys.modules


def test_a_missing_module_is_a_factor_so_that_adding_it_moves_the_key(tree):
    root = tree({"kc_kern.py": "try:\n    import kc_tuned\nexcept ImportError:\n    pass\n"})
    assert module_sources("kc_kern")["kc_tuned"] == ABSENT
    (root / "kc_tuned.py").write_text("BLOCK = 64\n")
    assert module_sources("kc_kern")["kc_tuned"] == file_digest(root / "kc_tuned.py")


def test_standard_and_installed_modules_end_the_walk_but_unrecorded_files_do_not(tmp_path, tree):
    site = pip_install(tmp_path / "site", [build_wheel(tmp_path / "wheels", "kc-lib", "1.0")])
    (site / "kc_loose.py").write_text("X = 1\n")  # copied into site-packages; no RECORD lists it
    sys.path.insert(0, str(site))
    try:
        tree({"kc_kern.py": "import os, json.decoder\nimport kcwheel_kc_lib\nimport kc_loose\n"})
        assert set(module_sources("kc_kern")) == {"kc_kern", "kc_loose"}
    finally:
        sys.path.remove(str(site))


def test_a_module_that_does_not_parse_fails_naming_it(tree):
    tree({"kc_kern.py": "import kc_helper\n", "kc_helper.py": "def (:\n"})
    with pytest.raises(SourceError, match=r"^source/kc_helper: .*kc_helper\.py does not parse"):
        module_sources("kc_kern")


@pytest.fixture
def unreadable_helper(tree, monkeypatch):
    """``kc_kern`` imports ``kc_helper``, whose file every open refuses (as for a non-root
    serving user and a mode-000 file): the fault injected where the file is read."""
    root = tree({"kc_kern.py": "import kc_helper\n", "kc_helper.py": "X = 1\n"})
    real_open = builtins.open

    def refusing(path, *args, **kwargs):
        if str(path) == str(root / "kc_helper.py"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    return root


def test_a_module_that_cannot_be_read_fails_naming_it(unreadable_helper):
    with pytest.raises(SourceError, match=r"^source/kc_helper: cannot read .*kc_helper\.py"):
        module_sources("kc_kern")


def test_a_warm_whose_kernels_import_an_unreadable_module_fails_naming_it(unreadable_helper):
    with pytest.raises(WarmError, match=r"cute-dsl warmer: cannot key the kernels: source/kc_help"):
        entry_point_sources("cute-dsl", ["kc_kern:warm"], None)


def test_a_check_whose_kernels_import_an_unreadable_module_is_a_mismatch(unreadable_helper):
    recorded = stamps.collect(arch="sm_90a", distributions=[], sources={"kc_kern": "blake3:0"})
    with pytest.raises(StampMismatchError, match=r"^source/kc_helper: cannot read"):
        stamps.environment_stamp(recorded)


def test_a_module_without_its_source_fails_naming_it(tree):
    root = tree({"kc_kern.py": "import kc_compiled\n", "kc_compiled.py": "X = 1\n"})
    py_compile.compile(str(root / "kc_compiled.py"), cfile=str(root / "kc_compiled.pyc"))
    (root / "kc_compiled.py").unlink()
    with pytest.raises(SourceError, match=r"^source/kc_compiled: .*kc_compiled\.pyc is bytecode"):
        module_sources("kc_kern")


def test_namespace_packages_are_walked_without_importing_their_parents(tree):
    """Folders without an ``__init__`` (namespace packages), one inside another: found by hand,
    where the import system would need the parent imported first."""
    root = tree(
        {"kc_ns/inner/kern.py": "from kc_ns.inner import tiles\n", "kc_ns/inner/tiles.py": ""}
    )
    assert module_sources("kc_ns.inner.kern") == {
        "kc_ns.inner.kern": file_digest(root / "kc_ns/inner/kern.py"),
        "kc_ns.inner.tiles": file_digest(root / "kc_ns/inner/tiles.py"),
    }
    assert "kc_ns" not in sys.modules
