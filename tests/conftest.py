"""Shared test set-up: the repo's examples are importable; CuTe-DSL tests target sm_90a.

CuTe-DSL compiles and exports for any arch on a CPU-only machine, so those tests run in CI.
``CUTE_DSL_ARCH`` must be set before the DSL is imported: it is read at import.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import jsonschema
import pytest
import yaml

from tests.tiers import MEASURED_SLOW

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SCHEMAS = REPO / "docs" / "cli-schemas"

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, str(EXAMPLES))

# Every deadline of the suite is scaled by this one setting (default 1): a slow or busy machine
# runs with KERNELCACHE_TEST_TIMEOUT_SCALE=3, say, instead of failing on waits it would meet.
# wait_until scales its timeout itself; any other deadline a test sets goes through scaled().
TIMEOUT_SCALE = float(os.environ.get("KERNELCACHE_TEST_TIMEOUT_SCALE") or 1)


def scaled(seconds: float) -> float:
    """A deadline of the suite, in seconds on this machine (``TIMEOUT_SCALE``)."""
    return seconds * TIMEOUT_SCALE


HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")


# The files that take longest, longest first: their tests' summed --durations, about 590 s down
# to 180 s on 2 cores with 6 workers (2026-12-02). Refresh it when a file's time moves much.
LONGEST_FILES = (
    "test_corruption.py", "test_runtime.py", "test_key_matrix_misses.py",
    "test_key_matrix_packages.py", "test_cluster.py", "test_warm_flashinfer.py",
    "test_key_matrix.py", "test_build.py", "test_warm_torch_compile.py", "test_bad_warmers.py",
    "test_operator_integration.py", "test_warm_b12x.py", "test_store_faults.py",
    "test_store_trust.py", "test_runtime_cute.py", "test_vllm.py", "test_operator_chaos.py",
    "test_operator_chaos_load.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests ``tests/tiers.py`` measured as slow are marked so (``-m "not slow"`` leaves
    them out), then the longest files first (``LONGEST_FILES``), then the others holding slow
    tests: under pytest-xdist (a file per worker, handed out in this order) the longest ones
    start at once instead of running alone at the end. Within a file the order stays: some
    files' tests build on the ones before them."""
    mark_measured_slow(items)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}

    def order(item: pytest.Item) -> int:
        return rank.get(item.path.name, len(rank) + (item.path not in slow))

    items.sort(key=order)


def mark_measured_slow(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test ``MEASURED_SLOW`` names (tests/test_tiers.py checks that each
    name is a test of its file)."""
    for item in items:
        if getattr(item, "originalname", item.name) in MEASURED_SLOW.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)


def system_tool(name: str) -> str:
    """The path of a program a test drives (``scripts/install-system-tools.sh`` installs it).

    Missing: the test skips, saying so; under CI (``CI`` set) it fails, since there the
    README's test command must have installed it and a skip would hide the gap.
    """
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed (scripts/install-system-tools.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; under CI that is a failure, not a skip")
    pytest.skip(message)


def subprocess_env(**overrides: str) -> dict[str, str]:
    """The environment for a child Python: examples importable, overrides applied. The
    runner's terminal size is not passed on (pytest-xdist's workers carry one): the CLI then
    prints at its width for a pipe, and a test that wants a width sets COLUMNS itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(REPO / "src"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env.update(overrides)
    return env


def run_kernelcache(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process, as a user or a Job runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kernelcache", *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=scaled(900),
    )


def serve_python(
    script: Path, *args: str, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess:
    """A serving process (an example or a helper script) in a fresh Python, as a pod starts
    one: ``subprocess_env(**env)``, output captured as text."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The failure's only stderr line; fails the test on a traceback or a multi-line error."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def kernelcache_doc(
    name: str, namespace: str | None = None, arches: tuple[str, ...] = ("sm_90a",), **spec: Any
) -> dict[str, Any]:
    """A KernelCache of one GPU class per arch and the demo CuTe-DSL warmer; ``spec`` adds or
    replaces fields of its spec. Without a namespace, the CLI files it under ``default``."""
    metadata = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return {
        "apiVersion": "kernelcache.dev/v1alpha1",
        "kind": "KernelCache",
        "metadata": metadata,
        "spec": {
            "model": "example/model",
            "engine": {"image": "ghcr.io/kernelcache/examples:0.1.0"},
            "gpuClasses": [{"name": a.replace("_", "-"), "arch": a} for a in arches],
            "warmers": [{"type": "cute-dsl", "entryPoints": ["demo_kernels:warm"]}],
            **spec,
        },
    }


def write_warmer_spec(
    tmp_path: Path, warmer: dict[str, Any], arch: str = "sm_90a", name: str = "kc"
) -> Path:
    """A one-arch KernelCache with a single warmer, written to ``tmp_path/kc.yaml``."""
    spec = tmp_path / "kc.yaml"
    spec.write_text(yaml.safe_dump(kernelcache_doc(name, arches=(arch,), warmers=[warmer])))
    return spec


def writes_one_file() -> dict:
    """A command warmer that leaves one Triton cache file: a publishable generation."""
    script = "import os; open(os.path.join(os.environ['TRITON_CACHE_DIR'], 'k'), 'w').write('x')"
    return {"type": "command", "command": [sys.executable, "-c", script]}


def entry_point_spec(tmp_path: Path, body: str, **warmer) -> Path:
    """A cute-dsl warmer whose entry point ``ep:warm`` has ``body`` (it compiles nothing)."""
    (tmp_path / "ep.py").write_text(
        "import os, signal, subprocess, sys, time\n\n\ndef warm(workload):\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
    )
    return write_warmer_spec(tmp_path, {"type": "cute-dsl", "entryPoints": ["ep:warm"], **warmer})


# The example spec's CuTe-DSL workload, cut to one size, dtype and tile: each build compiles
# little. DEMO_WORKLOAD is the serving example's: both dtypes, both tiles.
SMALL_WORKLOAD = {"sizes": [[128, 256]], "dtypes": ["float16"], "tiles": [[32, 32]]}
DEMO_WORKLOAD = {
    "sizes": [[128, 256]],
    "dtypes": ["float32", "float16"],
    "tiles": [[32, 32], [64, 64]],
}


def write_spec(tmp_path: Path, **changes) -> Path:
    """The example spec with a small workload, next to a copy of the example kernels."""
    doc = yaml.safe_load((EXAMPLES / "kernelcache.yaml").read_text())
    doc["spec"]["warmers"][0]["workload"] = SMALL_WORKLOAD
    for path, value in changes.items():
        target = doc["spec"]
        *parents, leaf = path.split(".")
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        target[leaf] = value
    spec = tmp_path / "kc.yaml"
    spec.write_text(yaml.safe_dump(doc))
    for example in ("demo_kernels.py", "demo_serve.py"):
        if not (tmp_path / example).exists():
            (tmp_path / example).write_text((EXAMPLES / example).read_text())
    return spec


def checked(command: str, stdout: str) -> Any:
    """The JSON a command printed, validated against its schema."""
    payload = json.loads(stdout)
    schema = json.loads((SCHEMAS / f"{command}.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(payload, schema, cls=jsonschema.Draft202012Validator)
    return payload


def dsl_declared_settings() -> dict[str, bool]:
    """``CUTE_DSL_<X>`` -> whether it affects compile, as the imported DSL's settings manager
    says (each setting read from a variable; computed ones have none)."""
    probe = (
        "import json; from cutlass.cutlass_dsl.cutlass import CuTeDSLEnvironmentManager as M\n"
        "print(json.dumps({e.source: e.affects_compile for e in M._ENV_VAR_SPEC"
        " if isinstance(e.source, str)}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return {f"CUTE_DSL_{suffix}": marked for suffix, marked in json.loads(proc.stdout).items()}


def shared_dir(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder that ``make`` fills once per test run, by whichever worker asks first.

    Under pytest-xdist each worker has a basetemp of its own below the run's; the folder is in
    the run's, and a file lock makes the other workers wait until it is complete. Tests only
    read it (a test that changes what it holds copies it first).
    """
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (root / "shared" / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@dataclass(frozen=True)
class DemoBuild:
    """The example spec (``write_spec``: the small workload, the kernels beside it) built for
    one arch: its folder, spec, store and the key's current generation."""

    dir: Path
    spec: Path
    store: Path
    key: str

    @property
    def generation(self) -> Path:
        from kernelcache.store import Store

        current = Store(self.store).current(self.key)
        assert current is not None, f"{self.key}: nothing published"
        return current


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory: pytest.TempPathFactory) -> DemoBuild:
    """The example built for sm_90a once per run, shared by every test that only reads it (the
    store is content-addressed: the same build anywhere else would be the same generation)."""

    def build(folder: Path) -> None:
        spec = write_spec(folder)
        args = ("build", "-f", str(spec), "--store", str(folder / "store"), "--arch", "sm_90a")
        proc = run_kernelcache(*args)
        assert proc.returncode == 0, proc.stderr

    folder = shared_dir(tmp_path_factory, "demo-sm_90a", build)
    return DemoBuild(folder, folder / "kc.yaml", folder / "store", "default/demo/sm_90a")


def publish_files(
    store: Any,
    key: str,
    files: dict[str, bytes],
    stamp: dict[str, Any],
    report: Any = None,
    **kw: Any,
) -> Any:
    """Publish ``files`` (path under ``files/`` -> bytes) as a new generation of ``key``
    through the store's own writer; ``kw`` goes to ``Writer.publish``. Returns its manifest."""
    with store.writer(key) as writer:
        staging = writer.staging()
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        return writer.publish(staging, stamp, {} if report is None else report, **kw)


T = TypeVar("T")


def wait_until(
    check: Callable[[], T], timeout: float = 30.0, what: str = "", interval: float = 0.05
) -> T:
    """Poll until ``check`` returns something truthy; fail with its last value. The timeout
    is scaled (``scaled``): a busy machine may take longer, never a different path."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what or check} ({scaled(timeout):g} s): last {value!r}"
            )
        time.sleep(interval)


def warm_on_a_full_volume(tmp_path: Path, command: list[str]) -> tuple[int, str, str]:
    """``kernelcache warm`` as the compile Job runs it, its store on a 512 KiB volume (a
    tmpfs in a private mount namespace) that the warmer fills: its exit code and the
    termination message it writes, and its stderr; skipped where no such namespace can be
    made."""
    volume, result = tmp_path / "volume", tmp_path / "termination-log"
    volume.mkdir()
    spec = write_spec(tmp_path, warmers=[{"type": "command", "command": command}])
    mount = f'mount -t tmpfs -o size=512k tmpfs {volume} && exec "$@"'
    warm = [
        sys.executable, "-m", "kernelcache", "warm", "-f", str(spec),
        "--store", str(volume / "store"), "--arch", "sm_90a", "--result", str(result),
    ]  # fmt: skip
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, "sh", *warm],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    if not result.exists() and ("unshare" in proc.stderr or "mount" in proc.stderr):
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[-200:]}")
    return proc.returncode, result.read_text(), proc.stderr


# Ports this test process reserved (``free_port``): their lock files stay open until it exits.
_PORT_LOCKS: list[IO[str]] = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a server the test starts later, that no other test
    process is handed meanwhile.

    Binding port 0 and closing the socket races: the kernel hands that same ephemeral port to
    the next port-0 bind of any process, and a test beside this one (a registry, a token
    service) then answers on it (a 404 from the wrong server). So the port is taken below the
    ephemeral range, where no port-0 bind lands, and reserved by a lock file that this process
    holds until it exits, which another worker (of this or any checkout) skips.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1025, min(20000, low - 4000))
    locks = Path(tempfile.gettempdir()) / "kernelcache-test-ports"
    locks.mkdir(exist_ok=True)
    for port in random.sample(range(first, low), min(2000, low - first)):
        handle = (locks / f"{port}.lock").open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:  # held by another test process, or in use
            handle.close()
            continue
        _PORT_LOCKS.append(handle)
        return port
    raise RuntimeError(f"no free port in {first}-{low - 1} on 127.0.0.1")
