"""TVM's runtime, trimmed to what llmlower's TVM executor uses, as a folder to put on PYTHONPATH of a machine
without TVM (the lent GPU machine: no registry, 64 MiB per run; the apache-tvm wheel is 100 MB, most of it the
compiler library).

The folder holds:
- tvm/: the Python modules a run of the executor imports (traced: a subprocess loads a CPU artifact with this
  folder first on its path and steps it), libtvm_runtime.so and libtvm_runtime_cuda.so (its CUDA device API and
  module loader), and the libcudart the latter links (found as the loader resolves it here; it lies beside it,
  where its RUNPATH $ORIGIN looks). Without libtvm_compiler.so, `import tvm` runs runtime-only.
- tvm_ffi/: the traced modules, libtvm_ffi.so and libtvm_ffi_testing.so (its Cython core links both), the core
  for this Python and for each Python tag asked for (from that tag's apache-tvm-ffi wheel, fetched with pip
  download), and a dist-info naming libtvm_ffi.so, by which tvm_ffi finds its library.
apache-tvm's wheel is py3-none (one build for every Python 3); only tvm_ffi's core is per Python version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TVM_LIBRARIES = ("libtvm_runtime.so", "libtvm_runtime_cuda.so")
FFI_LIBRARIES = ("libtvm_ffi.so", "libtvm_ffi_testing.so")  # the Cython core links both
CUDA_RUNTIME_LINKED = "libtvm_runtime_cuda.so"  # whose CUDA runtime (libcudart.so.N) travels beside it
FFI_DISTRIBUTION = "apache-tvm-ffi"
LICENSES = ("LICENSE", "NOTICE")

# Run in a subprocess with the folder first on sys.path: load and step a TVM CPU artifact (torch blocked, as on
# a deployment host), then print the files of every tvm / tvm_ffi module imported and the libraries loaded.
_TRACE = """
import json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import numpy as np
import tvm, tvm_ffi
from llmlower.runtime import Engine, StepBatch, sequential_block_tables
engine = Engine.load(sys.argv[1], weights="random", max_num_seqs=2, max_context=64)
executor = engine.executor
tables = sequential_block_tables(executor, [4, 4])
logits = executor.step(StepBatch([[1, 2, 3], [4]], [0, 0], tables))
executor.copy_blocks([(tables[0][0], tables[1][0])])
files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
print(json.dumps({
    "files": [f for f in files if "/tvm/" in f or "/tvm_ffi/" in f],
    "libraries": [tvm_ffi.LIB._name, *(lib._name for lib in tvm.base._LOADED_LIBS.values())],
    "runtime_only": tvm.base._RUNTIME_ONLY,
    "finite": bool(np.isfinite(logits).all()),
}))
"""


def package_dir(name: str) -> Path:
    """Where an installed package lives (tvm, tvm_ffi)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed here (install llmlower with its tvm extra)")
    return Path(spec.origin).parent


def trace(site: Path, artifact: Path, runtime_only: bool = False) -> dict:
    """The modules and libraries a run of the TVM executor on `artifact` uses, with `site` first on the path
    (`runtime_only`: have an installed TVM skip its compiler library, as the trimmed one does)."""
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1"}
    if runtime_only:
        env["TVM_USE_RUNTIME_LIB"] = "1"
    done = subprocess.run([sys.executable, "-c", _TRACE, str(artifact)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"tracing the TVM runtime on {artifact} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def linked_library(library: Path, soname_prefix: str) -> Path:
    """The file the dynamic loader resolves `library`'s dependency soname_prefix* to on this machine (ldd)."""
    output = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True).stdout
    match = re.search(rf"^\s*{re.escape(soname_prefix)}\S* => (/\S+)", output, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{library}: ldd resolves no {soname_prefix}* here (is the CUDA toolkit installed?)")
    return Path(match.group(1))


def core_name(tag: str) -> str:
    """The file name of tvm_ffi's Cython core for Python `tag` (cp312 -> core.cpython-312-x86_64-linux-gnu.so)."""
    return f"core.cpython-{tag[2:]}-x86_64-linux-gnu.so"


def ffi_core(tag: str, cache: Path) -> Path:
    """tvm_ffi's core for Python `tag`, from that tag's wheel of the installed apache-tvm-ffi version (pip
    download, cached in `cache`)."""
    version = importlib.metadata.version(FFI_DISTRIBUTION)
    target = cache / f"{FFI_DISTRIBUTION}-{version}-{core_name(tag)}"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        command += ["--python-version", f"{tag[2]}.{tag[3:]}", "-d", tmp, f"{FFI_DISTRIBUTION}=={version}"]
        subprocess.run(command, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (Path(tmp) / "core").write_bytes(archive.read(f"tvm_ffi/{core_name(tag)}"))
        (Path(tmp) / "core").rename(target)
    return target


def _copy(source: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, destination)


def build_site(site: Path, artifact: Path, tags: tuple[str, ...] = (), cache: Path | None = None) -> dict:
    """Write the trimmed runtime into `site` (replaced), traced on the TVM CPU artifact `artifact`; `tags`: the
    Python tags (cp312, ...) whose tvm_ffi core to add besides this Python's (their wheels cached in `cache`).
    Returns the trace of a run on the finished folder, which must use nothing outside it."""
    tvm_dir, ffi_dir = package_dir("tvm"), package_dir("tvm_ffi")
    shutil.rmtree(site, ignore_errors=True)
    for library in TVM_LIBRARIES:
        _copy(tvm_dir / "lib" / library, site / "tvm" / "lib" / library)
    cudart = linked_library(tvm_dir / "lib" / CUDA_RUNTIME_LINKED, "libcudart.so")
    _copy(cudart, site / "tvm" / "lib" / cudart.name)
    for name in LICENSES:
        _copy(tvm_dir / name, site / "tvm" / name)
    for library in FFI_LIBRARIES:
        _copy(ffi_dir / "lib" / library, site / "tvm_ffi" / "lib" / library)
    for tag in tags:
        _copy(ffi_core(tag, cache or site.parent / "wheels"), site / "tvm_ffi" / core_name(tag))
    version = importlib.metadata.version(FFI_DISTRIBUTION)
    dist_info = site / f"apache_tvm_ffi-{version}.dist-info"  # tvm_ffi finds its library through its RECORD
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {FFI_DISTRIBUTION}\nVersion: {version}\n")
    (dist_info / "RECORD").write_text("tvm_ffi/lib/libtvm_ffi.so,,\n")
    roots = {"tvm": tvm_dir, "tvm_ffi": ffi_dir}
    for file in map(Path, trace(site, artifact, runtime_only=True)["files"]):  # the installed modules a run uses
        for package, root in roots.items():
            if file.is_relative_to(root):
                _copy(file, site / package / file.relative_to(root))
    final = trace(site, artifact)  # the folder alone: a module still missing fails here
    used = [*final["files"], *final["libraries"]]
    outside = [f for f in used if not Path(f).resolve().is_relative_to(site.resolve())]
    if outside or not final["runtime_only"] or not final["finite"]:
        raise RuntimeError(f"the trimmed runtime in {site} does not run on its own: {final}")
    return final
