"""What runs on top of a compiled model keeps working on mixture-of-experts ones: speculative decoding (a
self-draft and prompt lookup) gives the tokens of plain decoding, the prefix cache hits without changing a token,
structured output stays valid, the server answers through the openai client, and the roofline study reports."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import openai
import pytest

from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.speculative import SpeculativeConfig
from llmlower.runtime.structured import StructuredOutput

PROMPTS = [
    "compile the graph, compile the graph, compile the graph, compile the",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):",
    "keys and values, keys and values, keys and",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def moe_artifacts(tiny_checkpoints, compiled) -> dict[str, Path]:
    """gpt-oss (sinks, clamped experts) on ONNX with a one-layer self-draft; Mixtral on TVM (paged)."""
    return {
        "onnx": compiled(tiny_checkpoints["gpt_oss"], draft_layers=1),
        "tvm": compiled(tiny_checkpoints["mixtral"], "tvm"),
    }


def _tokens(engine: Engine, prompts: list[str]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, GREEDY, chat=False)]


@pytest.mark.parametrize("method", ["self:1", "ngram"])
def test_speculative_decoding_gives_the_tokens_of_plain_decoding(method, moe_artifacts):
    plain = Engine.load(moe_artifacts["onnx"], max_num_seqs=4, max_context=96)
    speculative = SpeculativeConfig.parse(method, 3)
    engine = Engine.load(moe_artifacts["onnx"], max_num_seqs=4, max_context=96, speculative=speculative)
    assert _tokens(engine, PROMPTS) == _tokens(plain, PROMPTS)
    if method.startswith("self"):  # a self-draft always guesses (prompt lookup only where the text repeats)
        assert engine.stats().speculation.proposed > 0
    assert engine.stats().kv_blocks_used == 0


def test_the_prefix_cache_hits_and_changes_no_token(moe_artifacts):
    prefix = "The quick brown fox jumps over the lazy dog. " * 3
    prompts = [prefix + "Compilers", prefix + "caches hold"]
    cold = Engine.load(moe_artifacts["tvm"], max_num_seqs=2, max_context=128, enable_prefix_caching=False)
    warm = Engine.load(moe_artifacts["tvm"], max_num_seqs=2, max_context=128)
    warm.generate(prompts[:1], GREEDY, chat=False)
    assert _tokens(warm, prompts) == _tokens(cold, prompts)
    assert warm.stats().prefix_cache_hits > 0


def test_structured_output_is_valid_beside_a_free_request(moe_artifacts):
    engine = Engine.load(moe_artifacts["tvm"], max_num_seqs=2, max_context=128)
    constrained = SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutput(json=SCHEMA))
    alone = _tokens(engine, PROMPTS[2:3])
    free, structured = engine.generate([PROMPTS[2], "a person as JSON"], [GREEDY, constrained], chat=False)
    jsonschema.validate(json.loads(structured.text), SCHEMA)
    assert free.token_ids == alone[0]


def test_the_server_answers_through_the_openai_client(moe_artifacts, tmp_path, serving):
    engine = Engine.load(moe_artifacts["onnx"], max_num_seqs=4, max_context=96)
    expected = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8), chat=False)[0].text
    request = {"model": "gpt-oss", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    with serving(moe_artifacts["onnx"], "--served-model-name", "gpt-oss", log=tmp_path / "server.log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.completions.create(**request)
        streamed = client.completions.create(**request, stream=True)
        assert reply.choices[0].text == expected == "".join(chunk.choices[0].text for chunk in streamed)


def test_the_roofline_study_costs_the_chosen_experts(tiny_checkpoints):
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "llmlower.cli", "roofline", str(tiny_checkpoints["mixtral"]), "-o", out]
        options = ["--no-measure", "--batch", "1", "--prefill", "64", "--context", "96"]
        done = subprocess.run([*command, *options], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "moe_experts" in json.dumps(json.loads((Path(out) / "report.json").read_text()))
