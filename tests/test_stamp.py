"""Tests for kernelcache.stamp: what moves a cache key, and what must never move it."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import blake3
import pytest

from kernelcache import measure, stamp
from kernelcache.errors import ExitCode, ManifestError, NoGpuInfoError, SpecError
from kernelcache.measure import detect_arch
from kernelcache.stamp import FactorDiff, Stamp, collect, explain

ORIGINAL_PATH = os.environ.get("PATH", "")

PRINT_STAMP = "import json, kernelcache.stamp as s; print(json.dumps(s.collect().to_dict()))"

FAKE_NVIDIA_SMI = """\
import os, sys, time
if sys.argv[1:] != ["--query-gpu=name,compute_cap", "--format=csv,noheader"]:
    sys.exit(f"unexpected arguments: {sys.argv[1:]}")
time.sleep(float(os.environ.get("FAKE_SMI_SLEEP", "0")))
sys.stdout.write(os.environ.get("FAKE_SMI_OUT", ""))
sys.exit(int(os.environ.get("FAKE_SMI_RC", "0")))
"""


@pytest.fixture(autouse=True)
def no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No nvidia-smi and no CUTE_DSL_ARCH, so results do not depend on the test host."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An nvidia-smi on PATH that prints $FAKE_SMI_OUT and exits with $FAKE_SMI_RC."""
    bin_dir = tmp_path / "smi-bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\n{FAKE_NVIDIA_SMI}")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return monkeypatch


def run_collect(env: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PRINT_STAMP],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- digest stability across hosts ------------------------------------------------------


def test_digest_ignores_host_and_path_derived_environment(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUSERBASE"}
    base["PATH"] = ORIGINAL_PATH
    base["CUTE_DSL_ARCH"] = "sm_90a"
    dirs = {name: tmp_path / name for name in ("home-a", "home-b", "cwd-a", "cwd-b/deeper")}
    for d in dirs.values():
        d.mkdir(parents=True)

    env_a = {
        **base,
        "HOME": str(dirs["home-a"]),
        "HOSTNAME": "builder-7f9c",
        "TMPDIR": str(tmp_path),
        "TZ": "UTC",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "XDG_CACHE_HOME": str(dirs["home-a"] / ".cache"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton-a"),
        "CUTE_DSL_CACHE_DIR": str(tmp_path / "cute-a"),
        "POD_IP": "10.0.3.17",
    }
    reversed_path = os.pathsep.join(reversed(ORIGINAL_PATH.split(os.pathsep)))
    env_b = {
        **base,
        "PATH": reversed_path,
        "HOME": str(dirs["home-b"]),
        "HOSTNAME": "server-0",
        "TMPDIR": str(dirs["cwd-b/deeper"]),
        "TZ": "Asia/Kolkata",
        "LANG": "de_DE.UTF-8",
        "LC_ALL": "POSIX",
        "XDG_CACHE_HOME": str(tmp_path / "xdg-b"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton-b"),
        "CUTE_DSL_CACHE_DIR": str(tmp_path / "cute-b"),
        "POD_IP": "10.0.9.201",
    }
    env_b = dict(reversed(list(env_b.items())))

    a = run_collect(env_a, dirs["cwd-a"])
    b = run_collect(env_b, dirs["cwd-b/deeper"])

    assert a == b
    assert a["factors"]["arch"] == "sm_90a"
    assert str(tmp_path) not in json.dumps(a)
    assert not [v for v in a["factors"].values() if v.startswith("/")]


def test_different_arch_changes_digest_and_explain_names_arch_only(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": ORIGINAL_PATH, "CUTE_DSL_ARCH": "sm_90a"}
    a = run_collect(env, tmp_path)
    b = run_collect({**env, "CUTE_DSL_ARCH": "sm_100a"}, tmp_path)

    assert a["digest"] != b["digest"]
    assert a["compile_digest"] != b["compile_digest"]
    diffs = explain(Stamp.from_dict(a), Stamp.from_dict(b))
    assert diffs == [FactorDiff("arch", "sm_90a", "sm_100a")]


def test_collect_names_every_default_distribution_even_absent_ones() -> None:
    factors = collect(arch="sm_90a").factors
    for name in stamp.DEFAULT_DISTRIBUTIONS:
        assert f"dist/{name}" in factors
    assert {"arch", "cuda_runtime", "python_abi"} <= set(factors)
    assert "gpu_product" not in factors  # no GPU visible, none given
    assert factors["python_abi"].startswith(f"{sys.implementation.name}-")
    assert "/" not in factors["python_abi"]


# --- distributions ----------------------------------------------------------------------

BASE_ROWS = [
    "fakepkg/__init__.py,sha256=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,10",
    "fakepkg/core.py,sha256=BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB,2048",
    "fakepkg-{version}.dist-info/METADATA,sha256=CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC,60",
    "fakepkg-{version}.dist-info/RECORD,,",
]


class FakeSite:
    """Fresh site dirs, each holding one fake install, put first on sys.path in turn."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0

    def install(
        self,
        rows: list[str] | None = None,
        *,
        name: str = "fakepkg",
        version: str = "1.0",
        record: bool = True,
        files: dict[str, str] | None = None,
    ) -> Path:
        self.count += 1
        site = self.root / f"site{self.count}"
        info = site / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if record:
            lines = BASE_ROWS if rows is None else rows
            text = "\n".join(line.format(version=version) for line in lines) + "\n"
            (info / "RECORD").write_text(text)
        for rel, content in (files or {}).items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(content)
        return site

    def collect_with(self, site: Path | None, **kwargs: Any) -> Stamp:
        if site is None:
            return collect(arch="sm_90a", **kwargs)
        sys.path.insert(0, str(site))
        try:
            return collect(arch="sm_90a", **kwargs)
        finally:
            sys.path.remove(str(site))

    def factor(self, site: Path | None, dist: str = "fakepkg") -> str:
        return self.collect_with(site, distributions=[dist]).factors[f"dist/{dist}"]


@pytest.fixture
def sites(tmp_path: Path) -> FakeSite:
    return FakeSite(tmp_path / "sites")


def test_reinstall_of_same_wheel_bytes_hits(sites: FakeSite) -> None:
    first = sites.collect_with(sites.install(), distributions=["fakepkg"])
    again = sites.collect_with(sites.install(), distributions=["fakepkg"])
    assert first.factors["dist/fakepkg"].startswith("1.0 record=")
    assert again.digest == first.digest
    assert str(sites.root) not in json.dumps(first.to_dict())


def test_rebuilt_wheel_with_same_version_misses(sites: FakeSite) -> None:
    rebuilt = [BASE_ROWS[0], BASE_ROWS[1].replace("BBBB", "bBBB", 1), *BASE_ROWS[2:]]
    first = sites.collect_with(sites.install(), distributions=["fakepkg"])
    second = sites.collect_with(sites.install(rebuilt), distributions=["fakepkg"])

    diffs = explain(first, second)
    assert [d.name for d in diffs] == ["dist/fakepkg"]
    assert (diffs[0].left or "").startswith("1.0 record=")
    assert (diffs[0].right or "").startswith("1.0 record=")
    assert first.digest != second.digest


@pytest.mark.parametrize(
    "extra_rows",
    [
        pytest.param(["fakepkg/__pycache__/core.cpython-311.pyc,,"], id="pyc-without-hash"),
        pytest.param(
            ["fakepkg/__pycache__/core.cpython-311.pyc,sha256=PYCPYCPYC,812"],
            id="pycache-with-hash",
        ),
        pytest.param(["../../bin/fakepkg-cli,sha256=SHEBANGDIFFERS,233"], id="console-script"),
        pytest.param(["/opt/venv/bin/fakepkg-tool,sha256=ABSOLUTE,99"], id="absolute-path"),
        pytest.param(
            [
                "fakepkg-{version}.dist-info/INSTALLER,sha256=uvuvuvuvuv,3",
                "fakepkg-{version}.dist-info/REQUESTED,sha256=47DEQpj8HBSa,0",
                "fakepkg-{version}.dist-info/direct_url.json,sha256=FILEURL,77",
            ],
            id="installer-written-files",
        ),
    ],
)
def test_host_and_install_specific_rows_do_not_count(
    sites: FakeSite, extra_rows: list[str]
) -> None:
    plain = sites.factor(sites.install())
    assert sites.factor(sites.install([*BASE_ROWS, *extra_rows])) == plain
    assert sites.factor(sites.install([*extra_rows, *reversed(BASE_ROWS)])) == plain


def test_console_script_row_change_does_not_count(sites: FakeSite) -> None:
    one = sites.install([*BASE_ROWS, "../../bin/x,sha256=SHEBANG1,100"])
    other = sites.install([*BASE_ROWS, "../../bin/x,sha256=SHEBANG2,117"])
    assert sites.factor(one) == sites.factor(other)


def test_version_change_misses_and_absent_is_named(sites: FakeSite) -> None:
    v10 = sites.collect_with(sites.install(), distributions=["fakepkg"])
    v11 = sites.collect_with(sites.install(version="1.1"), distributions=["fakepkg"])
    gone = sites.collect_with(None, distributions=["fakepkg"])

    assert v11.factors["dist/fakepkg"].startswith("1.1 record=")
    assert [d.name for d in explain(v10, v11)] == ["dist/fakepkg"]
    assert gone.factors["dist/fakepkg"] == "absent"
    assert explain(gone, v10) == [FactorDiff("dist/fakepkg", "absent", v10.factors["dist/fakepkg"])]


def test_missing_record_and_canonical_names(sites: FakeSite) -> None:
    site = sites.install(record=False)
    assert sites.factor(site) == "1.0 record=missing"
    factors = sites.collect_with(site, distributions=["FakePkg", "fake_pkg.Other"]).factors
    assert factors["dist/fakepkg"] == "1.0 record=missing"
    assert factors["dist/fake-pkg-other"] == "absent"


def test_cuda_runtime_from_runtime_wheel(sites: FakeSite) -> None:
    site = sites.install(name="nvidia-cuda-runtime-cu12", version="12.8.90", rows=[])
    assert sites.collect_with(site).factors["cuda_runtime"] == "nvidia-cuda-runtime-cu12 12.8.90"


@pytest.mark.parametrize(
    ("version_py", "expected"),
    [
        ("cuda: Optional[str] = '12.8'\n", "torch 12.8"),
        ('cuda = "13.0"\n', "torch 13.0"),
        ("cuda: Optional[str] = None\n", "none"),
    ],
)
def test_cuda_runtime_from_torch_version_file(
    sites: FakeSite, version_py: str, expected: str
) -> None:
    for name in ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime"):
        if sites.factor(None, name) != "absent":
            pytest.skip(f"{name} is installed and takes precedence over torch")
    site = sites.install(
        name="torch",
        version="2.99.0",
        rows=["torch/version.py,sha256=VVV,40"],
        files={"torch/version.py": f"__version__ = '2.99.0'\n{version_py}"},
    )
    assert sites.collect_with(site, distributions=[]).factors["cuda_runtime"] == expected


# --- GPU product, sources, workload, extras ---------------------------------------------


def test_gpu_product_moves_digest_but_not_compile_digest() -> None:
    h100 = collect(arch="sm_90a", gpu_product="NVIDIA H100 80GB HBM3")
    h200 = collect(arch="sm_90a", gpu_product="NVIDIA H200")
    unknown = collect(arch="sm_90a")

    assert h100.digest != h200.digest
    assert h100.compile_digest == h200.compile_digest == unknown.compile_digest
    assert unknown.digest == unknown.compile_digest
    assert [d.name for d in explain(h100, h200)] == ["gpu_product"]
    assert explain(unknown, h200) == [FactorDiff("gpu_product", None, "NVIDIA H200")]


def test_empty_gpu_product_is_refused() -> None:
    with pytest.raises(SpecError, match="gpu_product"):
        collect(arch="sm_90a", gpu_product="")
    with pytest.raises(ValueError, match="gpu_product"):
        Stamp({"arch": "sm_90a", "gpu_product": ""})


def test_sources_and_workload_are_named_by_explain() -> None:
    base = collect(
        arch="sm_90a",
        sources={"warm.gemm": "blake3:aa"},
        workload={"shapes": [[1, 2]], "dtype": "bf16"},
    )
    same = collect(
        arch="sm_90a",
        sources={"warm.gemm": "blake3:aa"},
        workload={"dtype": "bf16", "shapes": [[1, 2]]},
    )
    new_source = collect(
        arch="sm_90a",
        sources={"warm.gemm": "blake3:bb"},
        workload={"shapes": [[1, 2]], "dtype": "bf16"},
    )
    new_workload = collect(
        arch="sm_90a",
        sources={"warm.gemm": "blake3:aa"},
        workload={"shapes": [[1, 2], [4, 8]], "dtype": "bf16"},
    )

    assert same.digest == base.digest
    assert [d.name for d in explain(base, new_source)] == ["source/warm.gemm"]
    assert [d.name for d in explain(base, new_workload)] == ["workload"]
    assert [d.name for d in explain(base, collect(arch="sm_90a"))] == [
        "source/warm.gemm",
        "workload",
    ]


def test_workload_digest_is_canonical_json() -> None:
    expected = "blake3:" + blake3.blake3(b'{"a":[1,"\xc3\xa9"],"b":2}').hexdigest()
    assert stamp.workload_digest({"b": 2, "a": [1, "é"]}) == expected
    with pytest.raises(SpecError, match="workload"):
        stamp.workload_digest({"a": {1, 2}})
    with pytest.raises(SpecError, match="workload"):
        stamp.workload_digest({"a": float("nan")})


def test_extra_factors_and_host_paths_refused() -> None:
    base = collect(arch="sm_90a", extra={"engine": "vllm"})
    assert base.factors["extra/engine"] == "vllm"
    other = collect(arch="sm_90a", extra={"engine": "sglang"})
    assert [d.name for d in explain(base, other)] == ["extra/engine"]
    with pytest.raises(SpecError, match="extra/cuda_home"):
        collect(arch="sm_90a", extra={"cuda_home": "/usr/local/cuda-12.8"})
    with pytest.raises(SpecError, match="source/mod"):
        collect(arch="sm_90a", sources={"mod": "~/src/mod.py"})
    not_strings: Any = {"n": 3}
    with pytest.raises(SpecError, match="not a string"):
        collect(arch="sm_90a", extra=not_strings)


def test_explain_lists_exactly_the_differences_sorted() -> None:
    left = Stamp({"b": "1", "a": "1", "same": "x", "gone": "g"})
    right = Stamp({"a": "2", "same": "x", "b": "1", "added": "n"})
    assert explain(left, right) == [
        FactorDiff("a", "1", "2"),
        FactorDiff("added", None, "n"),
        FactorDiff("gone", "g", None),
    ]
    assert explain(left, left) == []


def test_describe_is_one_short_line() -> None:
    diff = FactorDiff("dist/torch", "2.13.0 record=" + "ab12" * 16, "2.14.1 record=" + "cd" * 32)
    expected = "dist/torch: 2.13.0 record=ab12ab12ab12.. != 2.14.1 record=cdcdcdcdcdcd.."
    assert diff.describe() == expected
    assert FactorDiff("gpu_product", None, "NVIDIA H200").describe() == (
        "gpu_product: (no such factor) != NVIDIA H200"
    )
    assert FactorDiff("extra/x", "", "y").describe() == 'extra/x: "" != y'


# --- serialization ----------------------------------------------------------------------


def test_to_dict_from_dict_round_trip() -> None:
    original = collect(arch="sm_100a", gpu_product="NVIDIA B200", workload={"m": 1})
    data = original.to_dict()

    assert set(data) == {"digest", "compile_digest", "factors", "factor_digests"}
    assert list(data["factors"]) == sorted(data["factors"])
    assert Stamp.from_dict(json.loads(json.dumps(data))) == original
    assert stamp.from_json(stamp.to_json(original)) == original
    assert pickle.loads(pickle.dumps(original)) == original
    assert all(d.startswith("blake3:") for d in data["factor_digests"].values())


def _tampered(data: dict, edit: str) -> dict:
    data = json.loads(json.dumps(data))
    if edit == "digest":
        data["digest"] = "blake3:" + "0" * 64
    elif edit == "compile_digest":
        data["compile_digest"] = data["digest"]
    elif edit == "factor_value":
        data["factors"]["arch"] = "sm_100a"
    elif edit == "factor_digest":
        data["factor_digests"]["arch"] = data["factor_digests"]["python_abi"]
    elif edit == "extra_factor_digest":
        data["factor_digests"]["dist/ghost"] = "blake3:00"
    elif edit == "no_factor_digests":
        del data["factor_digests"]
    elif edit == "factors_not_object":
        data["factors"] = ["arch", "sm_90a"]
    elif edit == "non_string_value":
        data["factors"]["arch"] = 90
    elif edit == "empty_gpu_product":
        data["factors"]["gpu_product"] = ""
    return data


@pytest.mark.parametrize(
    "edit",
    [
        "digest",
        "compile_digest",
        "factor_value",
        "factor_digest",
        "extra_factor_digest",
        "no_factor_digests",
        "factors_not_object",
        "non_string_value",
        "empty_gpu_product",
    ],
)
def test_tampered_stamp_dict_is_a_manifest_error(edit: str) -> None:
    data = collect(arch="sm_90a", gpu_product="NVIDIA H200").to_dict()
    with pytest.raises(ManifestError) as info:
        Stamp.from_dict(_tampered(data, edit))
    assert info.value.code == ExitCode.MALFORMED_MANIFEST
    assert "\n" not in info.value.message


def test_from_json_rejects_non_json() -> None:
    with pytest.raises(ManifestError):
        stamp.from_json("{not json")
    with pytest.raises(ManifestError):
        stamp.from_json("[]")


# --- arch and GPU detection -------------------------------------------------------------


def test_explicit_arch_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    assert detect_arch("sm_90a") == "sm_90a"
    assert detect_arch() == "sm_80"
    assert collect().factors["arch"] == "sm_80"


@pytest.mark.parametrize("value", ["sm90", "90a", "SM_90A", "sm_9", "sm_90ab", "sm_1000a", ""])
def test_bad_arch_format_names_the_value(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NoGpuInfoError) as info:
        detect_arch(value)
    assert repr(value) in info.value.message
    assert info.value.code == ExitCode.NO_GPU_INFO
    if value:
        monkeypatch.setenv("CUTE_DSL_ARCH", value)
        with pytest.raises(NoGpuInfoError, match="CUTE_DSL_ARCH"):
            detect_arch()


@pytest.mark.parametrize("value", ["sm_80", "sm_86", "sm_90a", "sm_100a", "sm_100f", "sm_120a"])
def test_good_arch_formats(value: str) -> None:
    assert detect_arch(value) == value


def test_no_env_and_no_nvidia_smi_is_no_gpu_info() -> None:
    with pytest.raises(NoGpuInfoError) as info:
        detect_arch()
    message = info.value.message
    assert "nvidia-smi" in message
    assert "CUTE_DSL_ARCH" in message
    assert "\n" not in message
    assert measure.detect_gpu_product() is None
    with pytest.raises(NoGpuInfoError):
        collect()


@pytest.mark.parametrize(
    ("row", "arch"),
    [
        ("Tesla T4, 7.5", "sm_75"),
        ("NVIDIA A100-SXM4-80GB, 8.0", "sm_80"),
        ("NVIDIA A10G, 8.6", "sm_86"),
        ("NVIDIA L4, 8.9", "sm_89"),
        ("NVIDIA H100 80GB HBM3, 9.0", "sm_90a"),
        ("NVIDIA B200, 10.0", "sm_100a"),
        ("NVIDIA GeForce RTX 5090, 12.0", "sm_120a"),
    ],
)
def test_arch_from_visible_gpu(fake_smi: pytest.MonkeyPatch, row: str, arch: str) -> None:
    fake_smi.setenv("FAKE_SMI_OUT", f"{row}\n{row}\n")
    assert detect_arch() == arch
    assert measure.detect_gpu_product() == row.rpartition(",")[0]


def test_collect_records_product_only_for_the_visible_arch(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("FAKE_SMI_OUT", "NVIDIA H200, 9.0\n")
    detected = collect()
    assert detected.factors["arch"] == "sm_90a"
    assert detected.factors["gpu_product"] == "NVIDIA H200"
    fake_smi.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert collect().digest == detected.digest
    cross = collect(arch="sm_100a")
    assert "gpu_product" not in cross.factors
    assert collect(arch="sm_90a", gpu_product="NVIDIA H100").factors["gpu_product"] == "NVIDIA H100"


def test_mixed_gpus(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("FAKE_SMI_OUT", "NVIDIA H100 PCIe, 9.0\nNVIDIA H100 80GB HBM3, 9.0\n")
    assert detect_arch() == "sm_90a"
    assert measure.detect_gpu_product() == "NVIDIA H100 80GB HBM3+NVIDIA H100 PCIe"

    fake_smi.setenv("FAKE_SMI_OUT", "NVIDIA H100 PCIe, 9.0\nNVIDIA A100-PCIE-40GB, 8.0\n")
    with pytest.raises(NoGpuInfoError, match=r"different archs \(sm_80, sm_90a\)"):
        detect_arch()
    assert detect_arch("sm_90a") == "sm_90a"


@pytest.mark.parametrize(
    ("out", "rc", "said"),
    [
        ("NVIDIA-SMI has failed because it couldn't communicate with the driver.\n", "9", "driver"),
        ("", "0", "lists no GPU"),
        ("NVIDIA H100 80GB HBM3, [N/A]\n", "0", "[N/A]"),
    ],
)
def test_failing_nvidia_smi_is_no_gpu_info(
    fake_smi: pytest.MonkeyPatch, out: str, rc: str, said: str
) -> None:
    fake_smi.setenv("FAKE_SMI_OUT", out)
    fake_smi.setenv("FAKE_SMI_RC", rc)
    with pytest.raises(NoGpuInfoError) as info:
        detect_arch()
    assert said in info.value.message
    assert measure.detect_gpu_product() is None


def test_hanging_nvidia_smi_times_out(fake_smi: pytest.MonkeyPatch) -> None:
    fake_smi.setenv("FAKE_SMI_SLEEP", "30")
    fake_smi.setattr(measure, "NVIDIA_SMI_TIMEOUT_S", 0.3)
    with pytest.raises(NoGpuInfoError, match="did not answer"):
        detect_arch()


# --- files and sources ------------------------------------------------------------------


def test_file_digest(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4099
    (tmp_path / "blob").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    assert measure.file_digest(tmp_path / "blob") == "blake3:" + blake3.blake3(data).hexdigest()
    assert measure.file_digest(str(tmp_path / "empty")) == "blake3:" + blake3.blake3().hexdigest()


def test_import_and_collect_load_no_torch_cuda_or_dsl(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, kernelcache.stamp as s
        s.collect(arch="sm_90a")
        heavy = {"torch", "triton", "cutlass", "cuda", "flashinfer", "tvm_ffi", "numpy"}
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
        """
    )
    env = {**os.environ, "PATH": ORIGINAL_PATH}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_sm_count_comes_from_the_environment_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELCACHE_SM_COUNT", "188")
    assert measure.detect_sm_count() == 188
    for bad in ("0", "-4", "many", "1.5"):
        monkeypatch.setenv("KERNELCACHE_SM_COUNT", bad)
        with pytest.raises(SpecError, match=f"KERNELCACHE_SM_COUNT='{re.escape(bad)}' is not"):
            measure.detect_sm_count()
