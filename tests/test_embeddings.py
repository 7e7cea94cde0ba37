"""Text-embedding models (--task embed): a Qwen3-Embedding-style checkpoint (the base model's weights, no LM head)
compiled with the embed pass, whose engine pools each prompt's hidden states into one normalized vector, checked
against transformers' own sentence embeddings, and served on /v1/embeddings to the openai client."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from llmlower.api import compile_artifact
from llmlower.errors import GenerationError
from llmlower.passes import build_pipeline
from llmlower.runtime import Engine
from llmlower.runtime.tokenizer import Tokenizer
from llmlower.testing import write_tiny_checkpoint

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Compilers lower graphs to kernels; caches hold keys and values. " * 3,
    "Ünïcödé, 東京, emoji 🙂 and numbers 12345.",
    "a",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Path:
    """A tiny Qwen3 saved as its base model alone (architectures Qwen3Model, no lm_head), as embedding models ship."""
    directory = write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("embedder"))
    base = transformers.AutoModelForCausalLM.from_pretrained(directory).model
    (directory / "model.safetensors").unlink()
    base.save_pretrained(directory, safe_serialization=True)
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    return directory


@pytest.fixture(scope="module")
def artifacts(embedder, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(pooling, backend) -> the compiled embedder: last-token pooling on tvm (a paged KV cache), the mean on onnx
    (slots), each verified pass by pass and against the torch reference."""
    out = tmp_path_factory.mktemp("embed-artifacts")
    built = {}
    for pooling, backend in (("last", "tvm"), ("mean", "onnx")):
        target = out / f"{pooling}-{backend}"
        compile_artifact(embedder, target, build_pipeline(embed=pooling), backend=backend, verify=True)
        built[pooling, backend] = target
    return built


def _reference(checkpoint: Path, texts: list[str], pooling: str) -> list[np.ndarray]:
    """transformers' sentence embeddings: the base model's last hidden state, pooled, L2-normalized."""
    model = transformers.AutoModel.from_pretrained(checkpoint).eval()
    tokenizer = Tokenizer.from_dir(checkpoint)
    vectors = []
    for text in texts:
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0].double()
        vector = hidden[-1] if pooling == "last" else hidden.mean(0)
        vectors.append(torch.nn.functional.normalize(vector, dim=0).numpy())
    return vectors


@pytest.mark.parametrize(("pooling", "backend"), [("last", "tvm"), ("mean", "onnx")])
def test_batched_chunked_embeddings_equal_transformers(artifacts, embedder, pooling, backend):
    """Five texts at once, prompts cut into chunks of 8 tokens: each vector is unit length and at cosine >= 0.999
    from transformers'; the same text again (its prefix cached, for last-token pooling) gives the same vector."""
    if backend == "tvm":
        pytest.importorskip("tvm")
    engine = Engine.load(artifacts[pooling, backend], max_num_seqs=4, max_num_batched_tokens=8)
    vectors = engine.embed(TEXTS)
    for vector, expected in zip(vectors, _reference(embedder, TEXTS, pooling), strict=True):
        assert vector.dtype == np.float32 and abs(np.linalg.norm(vector) - 1) < 1e-5
        assert float(np.dot(vector, expected)) >= 0.999
    again = engine.embed(TEXTS[:1])[0]
    assert np.allclose(again, vectors[0], atol=1e-5)
    assert (engine.stats().prefix_cache_hits > 0) == (pooling == "last")  # a mean needs every row: no cache
    with pytest.raises(GenerationError, match="a list"):
        engine.embed("one text, not a list")


def test_the_embeddings_endpoint_with_the_openai_client(artifacts, embedder, tmp_path, serving):
    """/v1/embeddings: base64 (the client's default) and floats alike, in the inputs' order, with usage; dimensions
    keeps the leading ones renormalized; token ids in; an embedding model refuses completions, and bad inputs are
    400s naming the field."""
    artifact = artifacts["mean", "onnx"]
    expected = _reference(embedder, TEXTS, "mean")
    with serving(artifact, "--served-model-name", "embedder", "--max-embedding-inputs", "8", log=tmp_path / "log") as (
        url,
        _,
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model="embedder", input=TEXTS)
        assert [d.index for d in reply.data] == list(range(len(TEXTS)))
        for datum, vector in zip(reply.data, expected, strict=True):
            assert float(np.dot(datum.embedding, vector)) >= 0.999
        floats = client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="float")
        assert np.allclose(floats.data[0].embedding, reply.data[0].embedding, atol=1e-6)
        tokens = Tokenizer.from_dir(embedder).encode(TEXTS[0])
        assert reply.usage.prompt_tokens == sum(len(Tokenizer.from_dir(embedder).encode(t)) for t in TEXTS)
        by_ids = client.embeddings.create(model="embedder", input=[tokens], encoding_format="float")
        assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-6)
        short = client.embeddings.create(model="embedder", input=TEXTS[0], dimensions=16, encoding_format="float")
        leading = np.asarray(floats.data[0].embedding[:16])
        assert np.allclose(short.data[0].embedding, leading / np.linalg.norm(leading), atol=1e-5)
        raw = httpx.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": "hi", "encoding_format": "base64"})
        assert len(base64.b64decode(raw.json()["data"][0]["embedding"])) == 4 * len(floats.data[0].embedding)
        for body, param in [
            ({"input": []}, "input"),
            ({"input": ["x"] * 9}, "input"),
            ({"input": "x", "dimensions": 10**6}, "dimensions"),
        ]:
            bad = httpx.post(f"{url}/v1/embeddings", json={"model": "embedder", **body})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param
        with pytest.raises(openai.BadRequestError, match="embeds text"):
            client.completions.create(model="embedder", prompt="hi", max_tokens=2)
