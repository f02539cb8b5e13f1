"""The key-correctness matrix: what must never move a cache key, and what must always move it.

Its cases, run by tests/test_key_matrix.py (HIT), tests/test_key_matrix_packages.py (MISS by a
changed wheel) and tests/test_key_matrix_misses.py (every other MISS): three files, so that
pytest-xdist runs them side by side.

A generation is keyed by the environment stamp (``kernelcache.stamp``) and each CuTe-DSL kernel
in it by its disk-layer key (``kernelcache.runtime.cute``). Every case starts fresh processes
that differ from a baseline in one respect (``tests/helpers/key_worker.py`` computes both keys):

- HIT: a perturbation that cannot change the compiled code (host, paths, process, clock, a
  re-install of the same wheel bytes, ...). The stamp digest and every CuTe key must be the
  baseline's, and ``kernelcache explain <baseline generation> env``, run in the perturbed
  environment, must report a hit. The worker also reports what it saw, so a perturbation that
  never reached the process fails instead of passing vacuously.
- MISS: a perturbation that can change it (a package version, a rebuilt wheel, arch, GPU
  product, CUDA runtime, Python ABI, a source byte, workload, compile options, ...). The stamp
  digest must differ and ``kernelcache explain`` must name exactly the factors of the case and
  nothing else; the CuTe key must change in exactly the factors of the case.

Packages are real wheels installed by pip into a site directory put first on PYTHONPATH; each
one's metadata shadows the installed distribution of the same name, while the real modules
(the DSL among them) still import. A case that changes one wheel installs only that one, into
a site directory before the baseline's; a case about the install itself installs all. The
kernel module sits in a folder with its helpers, as in a spec's folder. GPUs are an
nvidia-smi stand-in on PATH (the only test double here: no GPU is needed). Hostname, PID,
clock and mount-point perturbations use Linux namespaces (``unshare``) and are skipped,
saying why, where those cannot be created.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import EXAMPLES, REPO, publish_files, scaled
from tests.helpers.wheels import build_wheel, pip_install

from kernelcache.errors import ExitCode
from kernelcache.runtime.cute_pipeline import IN_OPTIONS
from kernelcache.stamp import DEFAULT_DISTRIBUTIONS, TUNE_SCOPED
from kernelcache.store import Store

WORKER = REPO / "tests" / "helpers" / "key_worker.py"
KERNEL_MODULE = "cute_gemm"
BASE_VERSION, BUMPED_VERSION = "1.0.0", "1.0.1"
# CUDA runtime wheels, baseline and bumped versions: a CUDA 12 one and the unsuffixed CUDA 13
# one, both installed, as in an image whose libraries were built against different CUDAs.
CUDA_RUNTIMES = {
    "nvidia-cuda-runtime-cu12": ("12.8.90", "12.9.79"),
    "nvidia-cuda-runtime": ("13.0.96", "13.1.80"),
}
DSL_STACK = ("nvidia-cutlass-dsl", "apache-tvm-ffi")  # the distributions in a CuTe key
H200, H100, B200 = "NVIDIA H200, 9.0", "NVIDIA H100 80GB HBM3, 9.0", "NVIDIA B200, 10.0"
DECLARED: dict[str, Any] = {
    "workload": {
        "entryPoint": f"{KERNEL_MODULE}:gemm",
        "shapes": [[128, 128, 32]],
        "dtype": "Float32",
        "align": 16,
        "options": None,
        "env": {},
    },
    "extra": {"model": "example/llama-3-8b", "engine_image": "vllm/vllm-openai:v0.11.0"},
}
FAKE_NVIDIA_SMI = """\
import pathlib, sys
if sys.argv[1:] != ["--query-gpu=name,compute_cap", "--format=csv,noheader"]:
    sys.exit(f"unexpected arguments: {sys.argv[1:]}")
sys.stdout.write((pathlib.Path(__file__).parent / "gpus.csv").read_text())
"""
# The kernel module's project-local helpers beside it: its tile sizes come through a chain of
# modules three deep, and it imports a package with an __init__ and relative imports, and a
# tuning module that may or may not be there.
TILE_SIZES = b"BM, BN, BK = 64, 64, 16\n"
HELPER_IMPORTS = b"""\
from gemm_pkg import epilogue  # noqa: F401
from gemm_tiles import BK, BM, BN

try:
    import gemm_tuned  # noqa: F401
except ImportError:
    gemm_tuned = None
"""
KERNEL_HELPERS = {
    "gemm_tiles.py": "from gemm_tiles_k import BK\n\nBM, BN = 64, 64\n",
    "gemm_tiles_k.py": "from gemm_defaults import K_TILE as BK  # noqa: F401\n",
    "gemm_defaults.py": "K_TILE = 16\n",
    "gemm_pkg/__init__.py": "from .layout import ROW_MAJOR  # noqa: F401\n",
    "gemm_pkg/layout.py": "ROW_MAJOR = (1, 0)\n",
    "gemm_pkg/epilogue.py": "from . import layout\n\nSTRIDE_ORDER = layout.ROW_MAJOR\n",
}
# Compile-affecting settings of each toolchain: every CuTe-DSL one (the DSL's own list, see
# test_cute_dsl_switches_are_the_dsls_list), each with a value other than its default, and
# one or two of the others'. A setting changes the stamp; a CuTe-DSL one the CuTe key too.
CUTE_DSL_SWITCHES = {
    "CUTE_DSL_DEBUG": "1",
    "CUTE_DSL_LINEINFO": "1",
    "CUTE_DSL_ENABLE_PYIR": "1",
    "CUTE_DSL_AUTO_M2S": "1",
    "CUTE_DSL_TOLERATE_M2M": "0",
    "CUTE_DSL_DRYRUN": "1",
    "CUTE_DSL_WARNINGS_AS_ERRORS": "1",
    "CUTE_DSL_COMPILER_OPT": "remarks{ptx}",
    "CUTE_DSL_COMPILER_BACKEND": "mlir",
    "CUTE_DSL_ENABLE_ASSERTIONS": "1",
    "CUTE_DSL_ENABLE_TVM_FFI": "1",
    "CUTE_DSL_LOC_TRACEBACKS": "2",
    "CUTE_DSL_USE_EXTENSION_COMPILER": "1",
}
# The disk-layer factors each CuTe-DSL switch moves besides ``settings``: the traced IR (debug
# checks, line info, the PyIR front end, compiler options the DSL records in the module and
# the extension compiler emit other ops) and the pipeline the compiler receives.
# The settings the DSL applies only as compile options: keyed by the options they set, they
# move ``options`` and not ``settings``.
AS_OPTIONS_OF = {f"CUTE_DSL_{name.upper()}": {"settings"} for name in IN_OPTIONS}
CUTE_DSL_MOVES = {
    "CUTE_DSL_DEBUG": {"ir", "options"},
    "CUTE_DSL_LINEINFO": {"ir", "options"},
    "CUTE_DSL_ENABLE_PYIR": {"ir", "options"},
    "CUTE_DSL_ENABLE_ASSERTIONS": {"options"},
    "CUTE_DSL_COMPILER_OPT": {"ir", "options"},
    "CUTE_DSL_ENABLE_TVM_FFI": {"options"},
    "CUTE_DSL_USE_EXTENSION_COMPILER": {"ir", "options"},  # another pass pipeline
}
OTHER_SWITCHES = {
    "TRITON_DISABLE_LINE_INFO": "1",
    "TRITON_DEFAULT_FP_FUSION": "0",
    "TORCHINDUCTOR_USE_FAST_MATH": "1",
    "FLASHINFER_JIT_LINEINFO": "1",
    "B12X_PAGED_KV_TMA": "1",
}
UNSHARE, SH = shutil.which("unshare"), shutil.which("sh") or "/bin/sh"
SHELL_BUILTINS = {"umask"}


# --- how a process is started --------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """How one process is started; a perturbation is the difference between two Runs."""

    python: str
    env: Mapping[str, str]
    cwd: Path
    declared: Mapping[str, Any] = field(default_factory=lambda: DECLARED)
    wrapper: tuple[str, ...] = ()
    tty_stdin: bool = False

    def with_env(self, **changes: str) -> Run:
        return replace(self, env={**self.env, **changes})

    def declaring(self, **warmup: Any) -> Run:
        workload = {**self.declared["workload"], **warmup}
        return replace(self, declared={**self.declared, "workload": workload})

    def start(self, *args: str) -> subprocess.CompletedProcess[str]:
        stdin: int = subprocess.DEVNULL
        if self.tty_stdin:
            leader, stdin = os.openpty()
        try:
            return subprocess.run(
                [*self.wrapper, self.python, *args],
                env=dict(self.env),
                cwd=self.cwd,
                stdin=stdin,
                capture_output=True,
                text=True,
                timeout=scaled(300),
            )
        finally:
            if self.tty_stdin:
                os.close(leader)
                os.close(stdin)

    def key(self) -> dict[str, Any]:
        """The worker's report: stamp, CuTe keys and what the process observed."""
        proc = self.start(str(WORKER), json.dumps(self.declared))
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def explain(self, left: Path | str, right: Path | str) -> subprocess.CompletedProcess[str]:
        return self.start("-m", "kernelcache", "explain", str(left), str(right))


def wrapped(run: Run, unshare_flags: list[str], *commands: list[str]) -> Run:
    """``run`` behind a shell that runs ``commands`` first, in new namespaces when flags are
    given; skips the case, saying why, where this host cannot do that."""
    if unshare_flags and UNSHARE is None:
        pytest.skip("unshare (util-linux) is not installed")
    prefix = [UNSHARE, *unshare_flags] if unshare_flags else []
    steps = [shlex.join([host_tool(argv[0]), *argv[1:]]) for argv in commands]
    wrapper = (*prefix, SH, "-c", " && ".join([*steps, 'exec "$@"']), "sh")
    probe = subprocess.run(
        [*wrapper, run.python, "-c", ""], env=dict(run.env), capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot run {shlex.join(wrapper[:-1])} here: {probe.stderr.strip()}")
    return replace(run, wrapper=(*run.wrapper, *wrapper))


def host_tool(name: str) -> str:
    """A shell builtin as is, else the tool's path on this host (the runs' PATH has none)."""
    if name in SHELL_BUILTINS:
        return name
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"no {name} command on this host")
    return path


def explain_generations(left: Path, right: Path) -> subprocess.CompletedProcess[str]:
    """``kernelcache explain LEFT RIGHT`` of two generations, run by the CLI's ``main`` in this
    process: the two stamps on disk alone decide its answer, so a fresh interpreter adds only
    its start-up (about 0.6 CPU-s a case). ``explain GENERATION env`` runs in the perturbed
    process itself (``Run.explain``): there the environment is the point."""
    from kernelcache.cli import main

    args = ["explain", str(left), str(right)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        code = main(args)
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def explained(proc: subprocess.CompletedProcess[str]) -> set[str]:
    """The factor names ``kernelcache explain`` printed, one per line, for a mismatch."""
    assert proc.returncode == ExitCode.STAMP_MISMATCH, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
    return {line.partition(": ")[0] for line in proc.stdout.splitlines()}


# --- building environments -----------------------------------------------------------------


def new_dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir(parents=True)
    return path


def nvidia_smi(parent: Path, gpus: list[str]) -> Path:
    """A directory holding an nvidia-smi that lists ``gpus`` (``name, compute_cap`` rows)."""
    bin_dir = new_dir(parent, "nvidia-smi-bin")
    (bin_dir / "gpus.csv").write_text("".join(f"{row}\n" for row in gpus))
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\n{FAKE_NVIDIA_SMI}")
    script.chmod(0o755)
    return bin_dir


def app_library(parent: Path) -> Path:
    """A shared library of the application's, which its kernels link with."""
    library = new_dir(parent, "app/lib") / "libkernels_ext.so"
    library.write_bytes(b"")
    return library


def kernels_dir(parent: Path, source: bytes) -> Path:
    """A folder holding the kernel module and its helpers, as a spec's folder holds them."""
    folder = new_dir(parent, "kernels")
    (folder / f"{KERNEL_MODULE}.py").write_bytes(source)
    for relative, text in KERNEL_HELPERS.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    return folder


def with_helpers(source: bytes) -> bytes:
    """The example GEMM with its tile sizes imported from the helpers instead."""
    assert source.count(TILE_SIZES) == 1, "the example's tile sizes moved"
    return source.replace(TILE_SIZES, HELPER_IMPORTS)


def baseline_wheels(out_dir: Path) -> dict[str, Path]:
    """One wheel per distribution the stamp declares, and the CUDA runtime wheels."""
    wheels = {name: build_wheel(out_dir, name, BASE_VERSION) for name in DEFAULT_DISTRIBUTIONS}
    for name, (version, _) in CUDA_RUNTIMES.items():
        wheels[name] = build_wheel(out_dir, name, version)
    return wheels


def dsl_runtime(variant: str, prefix: Path = Path(sys.prefix)) -> str:
    """The DSL's runtime library of ``variant`` (cu12, cu13), as reached under ``prefix``."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    assert spec is not None and spec.submodule_search_locations
    package = Path(spec.submodule_search_locations[0])
    if package.is_relative_to(sys.prefix):
        package = prefix / package.relative_to(sys.prefix)
    return str(package / variant / "lib" / "libcute_dsl_runtime.so")


def search_path(*folders: Path) -> str:
    return os.pathsep.join(map(str, [*folders, REPO / "src"]))


def selecting_runtime(run: Run, runtime: str) -> Run:
    """``CUTE_DSL_LIBS`` (the runtime, then the application's libraries) with another runtime."""
    _, *others = run.env["CUTE_DSL_LIBS"].split(os.pathsep)
    return run.with_env(CUTE_DSL_LIBS=os.pathsep.join([runtime, *others]))


@dataclass(frozen=True)
class World:
    """The baseline: its environment, its worker report and its published generation."""

    wheels: dict[str, Path]
    site: Path
    kernels: Path
    base: Run
    report: dict[str, Any]
    generation: Path

    def path_with_smi(self, smi_dir: Path) -> str:
        """PATH with another nvidia-smi directory in place of the baseline's."""
        return os.pathsep.join([str(smi_dir), *self.base.env["PATH"].split(os.pathsep)[1:]])

    def installing(
        self, tmp: Path, changes: Mapping[str, Path | None], *, compile_bytecode: bool = True
    ) -> Run:
        """The baseline with a freshly installed site: ``changes`` replace or (None) drop wheels."""
        wheels = {**self.wheels, **changes}
        site = pip_install(
            tmp / "site",
            [w for w in wheels.values() if w is not None],
            compile_bytecode=compile_bytecode,
        )
        return self.base.with_env(PYTHONPATH=search_path(site, self.kernels))

    def overlaying(self, tmp: Path, changes: Mapping[str, Path]) -> Run:
        """The baseline with only the changed wheels installed, in a site directory before the
        baseline's: the first distribution of a name on the path is the one Python reports."""
        site = pip_install(tmp / "overlay", changes.values())
        return self.base.with_env(PYTHONPATH=search_path(site, self.site, self.kernels))


def publish(store_root: Path, stamp: dict[str, Any]) -> Path:
    """Publish an empty generation with ``stamp``; returns its directory."""
    store = Store(store_root)
    key = f"default/matrix/{stamp['factors']['arch']}"
    publish_files(store, key, {}, stamp)
    generation = store.current(key)
    assert generation is not None
    return generation


def build_world(root: Path) -> World:
    """The baseline under ``root``: the wheels installed, the kernels, the worker's report and
    the generation published with its stamp (each test file builds its own)."""
    wheels = baseline_wheels(root / "wheels")
    site = pip_install(root / "site", wheels.values())
    kernels = kernels_dir(root, with_helpers((EXAMPLES / f"{KERNEL_MODULE}.py").read_bytes()))
    # Only directories of the test's own on PATH, so that a host's real nvidia-smi never answers.
    path = [nvidia_smi(root, [H200]), new_dir(root, "bin-a"), new_dir(root, "bin-b")]
    env = {
        "PATH": os.pathsep.join(map(str, path)),
        "PYTHONPATH": search_path(site, kernels),
        "HOME": str(new_dir(root, "home")),
        "TMPDIR": str(new_dir(root, "tmp")),
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONNOUSERSITE": "1",
        "CUTE_DSL_ARCH": "sm_90a",
        # The libraries the DSL links kernels with: its cu13 runtime, and the application's own.
        "CUTE_DSL_LIBS": os.pathsep.join([dsl_runtime("cu13"), str(app_library(root))]),
    }
    base = Run(sys.executable, env, new_dir(root, "cwd"))
    report = base.key()
    return World(wheels, site, kernels, base, report, publish(root / "store", report["stamp"]))


# --- HIT: irrelevant perturbations ----------------------------------------------------------

Perturb = Callable[[World, Path], Run]


@dataclass(frozen=True)
class Hit:
    id: str
    observe: str  # what the worker reports that this perturbation must change
    perturb: Perturb


def configmap_kernels(world: World, tmp: Path) -> Run:
    """The kernel sources mounted from a ConfigMap: reached through two levels of symlinks."""
    mount = new_dir(tmp, "configmap")
    revision = mount / "..2025_01_01_00_00_00.000000001"
    shutil.copytree(world.kernels, revision)
    (mount / "..data").symlink_to(revision.name)
    for entry in world.kernels.iterdir():
        (mount / entry.name).symlink_to(f"..data/{entry.name}")
    return world.base.with_env(PYTHONPATH=search_path(world.site, mount))


def reordered_declaration(world: World, tmp: Path) -> Run:
    """The same spec with its keys in another order, as another YAML writer emits it."""
    declared = {key: dict(reversed(value.items())) for key, value in world.base.declared.items()}
    return replace(world.base, declared=dict(reversed(declared.items())))


def relocated_install(world: World, tmp: Path) -> Run:
    """The whole Python environment reached through another prefix, packages copied deeper."""
    prefix = tmp / "opt" / "serving" / "env"
    prefix.parent.mkdir(parents=True)
    prefix.symlink_to(sys.prefix, target_is_directory=True)
    python = Path(sys.executable)
    if not python.is_relative_to(sys.prefix):
        pytest.skip("the interpreter does not live under its prefix")
    site = shutil.copytree(world.site, tmp / "opt" / "serving" / "packages" / "site")
    kernels = shutil.copytree(world.kernels, tmp / "opt" / "serving" / "app" / "kernels")
    run = world.base.with_env(PYTHONPATH=search_path(site, kernels))
    run = selecting_runtime(run, dsl_runtime("cu13", prefix))
    return replace(run, python=str(prefix / python.relative_to(sys.prefix)))


def on_another_mount(world: World, tmp: Path) -> Run:
    """Packages and kernels copied onto a fresh tmpfs, mounted in a private mount namespace."""
    mount = new_dir(tmp, "mnt")
    run = world.base.with_env(PYTHONPATH=search_path(mount / "site", mount / "kernels"))
    return wrapped(
        run,
        ["--mount"],
        ["mount", "-t", "tmpfs", "kernelcache-matrix", str(mount)],
        ["cp", "-R", str(world.site), str(mount / "site")],
        ["cp", "-R", str(world.kernels), str(mount / "kernels")],
    )


def reinstalled_same_bytes(world: World, tmp: Path) -> Run:
    """The wheels rebuilt from the same inputs (byte-identical), installed again elsewhere."""
    wheels = baseline_wheels(tmp / "rebuilt-wheels")
    for name, wheel in wheels.items():
        assert wheel.read_bytes() == world.wheels[name].read_bytes(), name
    return world.installing(tmp, wheels)


def kernels_copy(world: World, tmp: Path, change: Callable[[Path], None]) -> Run:
    """The baseline with a changed copy of the kernels' folder."""
    kernels = shutil.copytree(world.kernels, tmp / "kernels")
    change(kernels)
    return world.base.with_env(PYTHONPATH=search_path(world.site, kernels))


def added_file(world: World, tmp: Path) -> Run:
    """A module beside the kernels that nothing imports."""
    return kernels_copy(world, tmp, lambda k: (k / "gemm_notes.py").write_text("X = 1\n"))


def touched_in_the_future(world: World, tmp: Path) -> Run:
    """Every installed file's timestamps moved to 2040, as an image layer rebuilt later has."""
    site = shutil.copytree(world.site, tmp / "site")
    for path in [site, *site.rglob("*")]:
        os.utime(path, (2_209_000_000, 2_209_000_000), follow_symlinks=False)
    return world.base.with_env(PYTHONPATH=search_path(site, world.kernels))


HITS = [
    Hit("home", "home", lambda w, t: w.base.with_env(HOME=str(new_dir(t, "home")))),
    Hit("cwd", "cwd", lambda w, t: replace(w.base, cwd=new_dir(t, "work/deeper"))),
    Hit("tmpdir", "tmpdir", lambda w, t: w.base.with_env(TMPDIR=str(new_dir(t, "tmp")))),
    Hit("timezone", "tzname", lambda w, t: w.base.with_env(TZ="IST-5:30")),
    Hit("locale", "locale", lambda w, t: w.base.with_env(LANG="POSIX", LC_ALL="POSIX")),
    Hit(
        "locale-encoding",
        "encoding",
        lambda w, t: w.base.with_env(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0"),
    ),
    Hit(
        "path-order",
        "environ",
        lambda w, t: w.base.with_env(
            PATH=os.pathsep.join(reversed(w.base.env["PATH"].split(os.pathsep)))
        ),
    ),
    Hit(
        "env-var-order",
        "env_order",
        lambda w, t: replace(w.base, env=dict(reversed(list(w.base.env.items())))),
    ),
    Hit(
        "hostname",
        "hostname",
        lambda w, t: wrapped(
            w.base.with_env(HOSTNAME="kc-serving-7f9c4"),
            ["--uts"],
            ["hostname", "kc-serving-7f9c4"],
        ),
    ),
    Hit("pod-ip", "environ", lambda w, t: w.base.with_env(POD_IP="10.244.3.17")),
    Hit(
        "node-name",
        "environ",
        lambda w, t: w.base.with_env(NODE_NAME="gpu-node-17", KUBERNETES_NODE_NAME="gpu-node-17"),
    ),
    Hit(
        "pod-identity",
        "environ",
        lambda w, t: w.base.with_env(
            POD_NAME="vllm-6d9f7-x2k4q",
            POD_NAMESPACE="serving",
            POD_UID="0b0e4c6a-1f7e-4d59-9a57-0c6c0a1f2b3d",
            HOSTNAME="vllm-6d9f7-x2k4q",
        ),
    ),
    Hit(
        "kubernetes-service-env",
        "environ",
        lambda w, t: w.base.with_env(
            KUBERNETES_SERVICE_HOST="10.96.0.1",
            KUBERNETES_SERVICE_PORT="443",
            KUBERNETES_PORT="tcp://10.96.0.1:443",
        ),
    ),
    Hit("pid", "pid", lambda w, t: wrapped(w.base, ["--pid", "--fork"])),
    Hit(
        "clock",
        "boot_days",
        lambda w, t: wrapped(
            w.base.with_env(SOURCE_DATE_EPOCH="1700000000"),
            ["--time", "--monotonic", "2592000", "--boottime", "2592000"],
        ),
    ),
    Hit(
        "toolchain-cache-dirs",
        "environ",
        lambda w, t: w.base.with_env(
            **{
                var: str(new_dir(t, var.lower()))
                for var in (
                    "TRITON_CACHE_DIR",
                    "TORCHINDUCTOR_CACHE_DIR",
                    "CUTE_DSL_CACHE_DIR",
                    "FLASHINFER_WORKSPACE_BASE",
                    "XDG_CACHE_HOME",
                )
            }
        ),
    ),
    Hit(
        "dsl-settings-that-do-not-compile",
        "environ",
        lambda w, t: w.base.with_env(
            CUTE_DSL_DUMP_DIR=str(new_dir(t, "dumps")),
            CUTE_DSL_NO_CACHE="1",
            CUTE_DSL_DISABLE_FILE_CACHING="1",
            CUTE_DSL_JIT_CACHE_MAX_ELEMS="8",
            CUTE_DSL_WARNINGS_IGNORE="1",
        ),
    ),
    Hit(
        "kernelcache-runtime-settings",
        "environ",
        lambda w, t: w.base.with_env(
            KERNELCACHE_DIR=str(new_dir(t, "materialized")),
            KERNELCACHE_CUTE_DSL_DIR=str(new_dir(t, "materialized/cute-dsl")),
            KERNELCACHE_STRICT="1",
        ),
    ),
    Hit(
        "cuda-visible-devices",
        "environ",
        lambda w, t: w.base.with_env(
            CUDA_VISIBLE_DEVICES="3", NVIDIA_VISIBLE_DEVICES="GPU-6f1c2d9e-3b7a-4c1e"
        ),
    ),
    Hit(
        "cuda-home-path",
        "environ",
        lambda w, t: w.base.with_env(
            CUDA_HOME=str(new_dir(t, "cuda-12.8")),
            CUDA_PATH=str(t / "cuda-12.8"),
            LD_LIBRARY_PATH=str(new_dir(t, "cuda-12.8/lib64")),
        ),
    ),
    Hit(
        "gpu-count",
        "gpus",
        lambda w, t: w.base.with_env(PATH=w.path_with_smi(nvidia_smi(t, [H200] * 8))),
    ),
    Hit("mount-point", "site_device", on_another_mount),
    Hit("install-prefix", "prefix", relocated_install),
    Hit("reinstall-same-wheel-bytes", "record", reinstalled_same_bytes),
    Hit(
        "reinstall-without-bytecode",
        "record",
        lambda w, t: w.installing(t, {}, compile_bytecode=False),
    ),
    Hit("file-mtimes", "site_mtime", touched_in_the_future),
    Hit("kernels-from-configmap", "kernel_file", configmap_kernels),
    Hit("spec-key-order", "declared_order", reordered_declaration),
    Hit("umask", "umask", lambda w, t: wrapped(w.base, [], ["umask", "077"])),
    Hit("pythonhashseed", "hash", lambda w, t: w.base.with_env(PYTHONHASHSEED="4242")),
    Hit("stdin-tty", "stdin_tty", lambda w, t: replace(w.base, tty_stdin=True)),
    Hit("module-beside-kernels-not-imported", "kernel_file", lambda w, t: added_file(w, t)),
    Hit(
        "toolchain-settings-that-do-not-compile",
        "environ",
        lambda w, t: w.base.with_env(
            TRITON_CACHE_AUTOTUNING="1",
            TRITON_PRINT_AUTOTUNING="1",
            TRITON_LIBDEVICE_PATH=str(t / "libdevice.10.bc"),
            TORCHINDUCTOR_COMPILE_THREADS="1",
            TORCHINDUCTOR_FX_GRAPH_CACHE="1",
            FLASHINFER_LOGLEVEL="3",
            FLASHINFER_CUDA_ARCH_LIST="9.0a",
            FLASHINFER_JIT_BUILD_LOG=str(t / "build.jsonl"),
            B12X_TIMING="1",
            B12X_COMPILE_CACHE_DIR=str(new_dir(t, "b12x")),
            CUTE_DSL_KEEP="ptx",
        ),
    ),
]


def changed(left: Mapping[str, Any], right: Mapping[str, Any]) -> set[str]:
    """Names of the factors that differ between two factor maps (added or removed included)."""
    return {name for name in {*left, *right} if left.get(name) != right.get(name)}


def changed_cute_factors(base: list[dict], other: list[dict]) -> set[str]:
    """Names of the disk-layer key factors that differ, over the kernels of both reports."""
    pairs = zip(base, other, strict=True)
    return {name for a, b in pairs for name in changed(a["factors"], b["factors"])}


def check_hit(world: World, case: Hit, tmp_path: Path) -> None:
    """The perturbed process sees the change, and its stamp, CuTe keys and ``explain`` hit."""
    run = case.perturb(world, tmp_path)
    report = run.key()
    seen, base_seen = report["observed"][case.observe], world.report["observed"][case.observe]
    assert seen != base_seen, f"the perturbation did not reach the process ({case.observe})"

    base_stamp, stamp = world.report["stamp"], report["stamp"]
    false_miss = changed(base_stamp["factors"], stamp["factors"])
    assert stamp == base_stamp, f"false miss in the stamp: {sorted(false_miss)}"
    assert changed_cute_factors(world.report["cute"], report["cute"]) == set()
    assert [k["digest"] for k in report["cute"]] == [k["digest"] for k in world.report["cute"]]

    proc = run.explain(world.generation, "env")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"same stamp {base_stamp['digest']}: a hit"


# --- MISS: relevant perturbations -----------------------------------------------------------


@dataclass(frozen=True)
class Miss:
    id: str
    perturb: Perturb
    stamp: frozenset[str]  # the factors `kernelcache explain` must name, and no others
    cute: frozenset[str] = frozenset()  # the CuTe key factors that must change, and no others
    # Measured: recomputed by `explain <generation> env` in the perturbed environment. The
    # rest is declared by the build (workload, model, image, arch, GPU product) and is
    # compared generation to generation.
    measured: bool = True


def bumped(name: str, version: str = BUMPED_VERSION) -> Perturb:
    def perturb(world: World, tmp: Path) -> Run:
        return world.overlaying(tmp, {name: build_wheel(tmp / "wheels", name, version)})

    return perturb


def rebuilt_same_version(world: World, tmp: Path) -> Run:
    """nvidia-cutlass-dsl rebuilt: one byte of a module differs, the version does not."""
    wheel = build_wheel(tmp / "wheels", "nvidia-cutlass-dsl", BASE_VERSION, build="2")
    return world.overlaying(tmp, {"nvidia-cutlass-dsl": wheel})


def libs_variant_cu12(world: World, tmp: Path) -> Run:
    """An image without the cu13 extra: the cu13 libraries absent, the cu12 runtime selected."""
    run = world.installing(tmp, {"nvidia-cutlass-dsl-libs-cu13": None})
    return selecting_runtime(run, dsl_runtime("cu12"))


def other_python_abi(world: World, tmp: Path) -> Run:
    """The interpreter reports a debug-build ABI, as a cross-build environment points it at
    another build configuration (``_PYTHON_SYSCONFIGDATA_NAME``)."""
    config = dict(sysconfig.get_config_vars())
    impl, version, *rest = str(config["SOABI"]).split("-")
    config["SOABI"] = "-".join([impl, f"{version}d", *rest])
    folder = new_dir(tmp, "build-config")
    (folder / "_sysconfigdata_matrix.py").write_text(f"build_time_vars = {config!r}\n")
    pythonpath = os.pathsep.join([str(folder), world.base.env["PYTHONPATH"]])
    return world.base.with_env(
        _PYTHON_SYSCONFIGDATA_NAME="_sysconfigdata_matrix", PYTHONPATH=pythonpath
    )


def kernel_source_byte(world: World, tmp: Path) -> Run:
    source = bytearray((world.kernels / f"{KERNEL_MODULE}.py").read_bytes())
    source[source.index(b"fp32")] = ord("F")
    kernels = kernels_dir(tmp, bytes(source))
    return world.base.with_env(PYTHONPATH=search_path(world.site, kernels))


def retuned(relative: str, text: str = "# retuned\n") -> Perturb:
    """A helper beside the kernel module changed (or, absent before, added)."""

    def change(kernels: Path) -> None:
        path = kernels / relative
        path.write_text((path.read_text() if path.exists() else "") + text)

    return lambda w, t: kernels_copy(w, t, change)


def setting(name: str, value: str) -> Perturb:
    return lambda w, t: w.base.with_env(**{name: value})


def gpus(*rows: str, **env: str) -> Perturb:
    return lambda w, t: w.base.with_env(PATH=w.path_with_smi(nvidia_smi(t, list(rows))), **env)


def declaring(**warmup: Any) -> Perturb:
    return lambda w, t: w.base.declaring(**warmup)


def serving(**extra: str) -> Perturb:
    return lambda w, t: replace(
        w.base, declared={**w.base.declared, "extra": {**w.base.declared["extra"], **extra}}
    )


def miss(
    id: str, perturb: Perturb, stamp: Iterable[str], cute: Iterable[str] = (), measured: bool = True
) -> Miss:
    return Miss(id, perturb, frozenset(stamp), frozenset(cute), measured)


# A wheel changed: each installs one (or all) of them.
PACKAGE_MISSES = [
    *(
        miss(
            f"version-{name}",
            bumped(name),
            {f"dist/{name}"},
            {"dsl"} if name.startswith(DSL_STACK) else set(),
        )
        for name in DEFAULT_DISTRIBUTIONS
    ),
    miss("rebuilt-wheel-same-version", rebuilt_same_version, {"dist/nvidia-cutlass-dsl"}, {"dsl"}),
    miss(
        "dsl-libs-variant-cu13-to-cu12",
        libs_variant_cu12,
        {"dist/nvidia-cutlass-dsl-libs-cu13"},
        {"dsl", "settings"},
    ),
    *(
        miss(f"cuda-runtime-{name}", bumped(name, bumped_version), {"cuda_runtime"})
        for name, (_, bumped_version) in CUDA_RUNTIMES.items()
    ),
]


# Everything else: the host's GPUs, the spec, the kernels' sources, a setting.
OTHER_MISSES = [
    miss("python-abi", other_python_abi, {"python_abi"}),
    # A docstring byte: the stamp's source factor moves, the kernel's IR does not.
    miss("kernel-source-byte", kernel_source_byte, {f"source/{KERNEL_MODULE}"}),
    # A B200 node: the arch, and the product tuning results are scoped to.
    miss(
        "arch",
        gpus(B200, CUTE_DSL_ARCH="sm_100a"),
        {"arch", "gpu_product"},
        {"arch", "settings", "ir", "options"},  # the pipeline's cubin-chip
        measured=False,
    ),
    miss("gpu-product", gpus(H100), {"gpu_product"}, measured=False),
    miss(
        "workload-shape",
        declaring(shapes=[[256, 128, 32]]),
        {"workload"},
        {"ir"},
        measured=False,
    ),
    miss("tensor-alignment", declaring(align=8), {"workload"}, {"ir"}, measured=False),
    miss(
        "compile-options",
        declaring(options="--host-target linux-aarch64"),
        {"workload"},
        {"options"},
        measured=False,
    ),
    miss(
        "dsl-compile-setting",
        declaring(env={"CUTE_DSL_LINEINFO": "1"}),
        {"workload"},
        CUTE_DSL_MOVES["CUTE_DSL_LINEINFO"],
        measured=False,
    ),
    miss("helper-1-deep", retuned("gemm_tiles.py"), {"source/gemm_tiles"}),
    miss("helper-2-deep", retuned("gemm_tiles_k.py"), {"source/gemm_tiles_k"}),
    miss("helper-3-deep", retuned("gemm_defaults.py"), {"source/gemm_defaults"}),
    miss("helper-package-init", retuned("gemm_pkg/__init__.py"), {"source/gemm_pkg"}),
    miss(
        "helper-package-relative-import",
        retuned("gemm_pkg/layout.py"),
        {"source/gemm_pkg.layout"},
    ),
    miss(
        "helper-submodule-from-import",
        retuned("gemm_pkg/epilogue.py"),
        {"source/gemm_pkg.epilogue"},
    ),
    miss(
        "helper-optional-module-appears",
        retuned("gemm_tuned.py", "BM = 128\n"),
        {"source/gemm_tuned"},
    ),
    *(
        miss(
            f"setting-{name}",
            setting(name, value),
            {f"setting/{name}"},
            ({"settings"} - AS_OPTIONS_OF.get(name, set())) | CUTE_DSL_MOVES.get(name, set()),
        )
        for name, value in CUTE_DSL_SWITCHES.items()
    ),
    *(
        miss(f"setting-{name}", setting(name, value), {f"setting/{name}"})
        for name, value in OTHER_SWITCHES.items()
    ),
    # Read only by Triton's C++ core: a build asks Triton for it, a check cannot (it would
    # import Triton), and Triton keys its own cache on it, so serving compiles, never loads.
    miss(
        "setting-triton-core-only",
        setting("DISABLE_MMA_V3", "1"),
        {"setting/DISABLE_MMA_V3"},
        measured=False,
    ),
    miss("model", serving(model="example/llama-3-70b"), {"extra/model"}, measured=False),
    miss(
        "engine-image",
        serving(engine_image="vllm/vllm-openai:v0.11.1"),
        {"extra/engine_image"},
        measured=False,
    ),
]

MISSES = [*PACKAGE_MISSES, *OTHER_MISSES]


def check_miss(world: World, case: Miss, tmp_path: Path) -> None:
    """The stamp and the CuTe key move, and ``explain`` names exactly the case's factors."""
    run = case.perturb(world, tmp_path)
    report = run.key()
    base_stamp, stamp = world.report["stamp"], report["stamp"]
    assert stamp["digest"] != base_stamp["digest"], "false hit in the stamp"
    tuning_only = case.stamp <= TUNE_SCOPED
    assert (stamp["compile_digest"] == base_stamp["compile_digest"]) == tuning_only

    generation = publish(tmp_path / "store", stamp)
    assert explained(explain_generations(world.generation, generation)) == case.stamp
    if case.measured:
        assert explained(run.explain(world.generation, "env")) == case.stamp

    assert changed_cute_factors(world.report["cute"], report["cute"]) == case.cute
    base_keys = [k["digest"] for k in world.report["cute"]]
    keys = [k["digest"] for k in report["cute"]]
    assert (keys == base_keys) == (not case.cute), "CuTe disk-layer key"
