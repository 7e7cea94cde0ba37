"""LoRA adapters: a tiny Llama compiled with adapter slots (the lora pass) on onnx and tvm, PEFT adapters of
different targets, ranks and scalings loaded at run time, several of them and the base model in one batch, each
answering PEFT's merged model's greedy tokens; the prefix cache keeps adapters apart; slots, names and files are
checked; the server selects an adapter by `model` and loads and unloads adapters on request."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import peft
import pytest
import torch
import transformers

from llmlower.api import compile_artifact
from llmlower.cli import main
from llmlower.errors import ArgumentError, GenerationError
from llmlower.passes import build_pipeline
from llmlower.runtime import Engine, SamplingParams
from llmlower.runtime.artifact import read_manifest
from llmlower.runtime.tokenizer import Tokenizer
from llmlower.testing import transformers_greedy, write_tiny_checkpoint

RANK, SLOTS, NEW_TOKENS = 8, 2, 10
PROMPTS = [[5, 17, 33, 42, 7, 99, 3], list(range(40, 75))]  # the second spans two KV blocks: a cached prefix
ADAPTERS = {  # name -> PEFT LoraConfig options: attention only (rsLoRA), every linear at a smaller rank (bfloat16)
    "attn": {"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    "all": {
        "r": 4,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "alpha_pattern": {"down_proj": 32},
    },
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """PEFT adapters with random, large B (PEFT starts B at zero, which would change nothing), saved by PEFT, and
    each one's merged model beside it (merge_and_unload, saved as a checkpoint)."""
    out = tmp_path_factory.mktemp("lora-adapters")
    saved = {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = peft.LoraConfig(init_lora_weights=False, **options)
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(checkpoint), config)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.mul_(30)
        if name == "all":
            model = model.to(torch.bfloat16)
        model.save_pretrained(out / name)
        merged = model.merge_and_unload().to(torch.float32)
        merged.save_pretrained(out / f"{name}-merged")
        saved[name] = out / name
    return saved


@pytest.fixture(scope="module")
def expected(checkpoint, adapters) -> dict[tuple[str, int], list[int]]:
    """(adapter or "base", prompt index) -> transformers' greedy tokens of the base or merged model."""
    models = {"base": checkpoint, **{name: path.with_name(f"{name}-merged") for name, path in adapters.items()}}
    return {
        (name, index): transformers_greedy(model, prompt, NEW_TOKENS)
        for name, model in models.items()
        for index, prompt in enumerate(PROMPTS)
    }


@pytest.fixture(scope="module")
def artifacts(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint with 2 adapter slots of rank 8 on onnx (per-sequence caches) and tvm (paged), verified."""
    out = tmp_path_factory.mktemp("lora-artifacts")
    pipeline = build_pipeline(lora={"rank": RANK, "max_loras": SLOTS})
    return {
        backend: compile_artifact(checkpoint, out / backend, pipeline, backend=backend, verify=True)
        for backend in ("onnx", "tvm")
    }


def _greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, lora=lora)


@pytest.mark.parametrize("backend", ["onnx", "tvm"])
def test_adapters_and_the_base_model_in_one_batch_equal_peft_merged(artifacts, adapters, expected, backend):
    """Every mix of adapters and the base model in one batch gives each request its merged model's tokens; a
    prompt cached by one adapter is computed again for another (the prefix cache's hashes start from the adapter).
    The slots leave the fusions in place: q/k/v with rope and attention, gate/up with SwiGLU."""
    if backend == "tvm":
        pytest.importorskip("tvm")
    stats = {step["name"]: step["stats"] for step in read_manifest(artifacts[backend], verify=False)["pipeline"]}
    assert stats["fuse_projections"]["silu_mul"] == stats["fuse_qkv_attention"]["qkv_attention"] == 2  # kept
    engine = Engine.load(artifacts[backend], loras=adapters, max_num_seqs=8)
    assert engine.loras == ["attn", "all"]
    names = [None, "attn", "all", "attn", None, "all"]
    for index, prompt in enumerate(PROMPTS):
        results = engine.generate([prompt] * len(names), [_greedy(name) for name in names], chat=False)
        for name, result in zip(names, results, strict=True):
            assert result.token_ids == expected[name or "base", index], (name, index)
    for name in ("all", None, "attn"):  # one at a time: each finds the others' blocks of this prompt cached
        [result] = engine.generate([PROMPTS[1]], _greedy(name), chat=False)
        assert result.token_ids == expected[name or "base", 1], name


def test_slots_names_and_adapter_files_are_checked(artifacts, adapters, checkpoint, tmp_path):
    """Loading past the slots, a name twice, an unknown name in a request, a rank above the slots' and files that
    are not a safetensors adapter each fail with a message naming the cause; an unloaded adapter's slot takes the
    next one, which then answers as itself."""
    engine = Engine.load(artifacts["onnx"], loras=adapters)
    with pytest.raises(ArgumentError, match="all 2 adapter slots"):
        engine.load_lora("third", adapters["attn"])
    with pytest.raises(ArgumentError, match="loaded already"):
        engine.load_lora("attn", adapters["all"])
    with pytest.raises(GenerationError, match="'nope': no adapter of that name"):
        engine.generate([PROMPTS[0]], _greedy("nope"), chat=False)
    assert engine.unload_lora("attn") and not engine.unload_lora("attn")
    engine.load_lora("attn-again", adapters["attn"])
    [result] = engine.generate([PROMPTS[0]], _greedy("attn-again"), chat=False)
    [base] = engine.generate([PROMPTS[0]], _greedy(None), chat=False)
    assert result.token_ids != base.token_ids
    wide = tmp_path / "wide"
    config = peft.LoraConfig(r=16, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(checkpoint), config).save_pretrained(wide)
    engine.unload_lora("all")
    with pytest.raises(ArgumentError, match="rank 16 exceeds the artifact's --lora-rank 8"):
        engine.load_lora("wide", wide)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapters["attn"] / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ArgumentError, match="adapter_model.bin is pickle"):
        engine.load_lora("pickled", pickled)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    real = (adapters["attn"] / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(real[: len(real) // 2])
    with pytest.raises(ArgumentError, match="do not fit shape"):
        engine.load_lora("truncated", truncated)
    assert engine.loras == ["attn-again"]


def test_the_server_selects_loads_and_unloads_adapters(artifacts, adapters, expected, checkpoint, serving, tmp_path):
    """`model` names an adapter loaded by --lora (the reply names it too, /v1/models lists it under the base);
    /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the key) add and remove one while the server runs;
    an unloaded or unknown name is a 404, a bad path a 400 naming lora_path."""
    decode = Tokenizer.from_dir(checkpoint).decode
    flags = ["--served-model-name", "tiny", "--lora", f"attn={adapters['attn']}", "--enable-lora-loading"]
    with serving(artifacts["onnx"], *flags, "--api-key", "k", log=tmp_path / "log") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {"tiny", "attn"} and cards["attn"].parent == "tiny"

        def complete(model: str) -> str:
            reply = client.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert reply.model == model
            return reply.choices[0].text

        assert complete("attn") == decode(expected["attn", 0])
        assert complete("tiny") == decode(expected["base", 0])
        headers = {"Authorization": "Bearer k"}
        load = {"lora_name": "all", "lora_path": str(adapters["all"])}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=headers).status_code == 200
        assert complete("all") == decode(expected["all", 0])
        bad = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, headers=headers
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        assert (
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "all"}, headers=headers).status_code == 200
        )
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "all"}, headers=headers)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
        with pytest.raises(openai.NotFoundError, match="`all` does not exist"):
            complete("all")
        assert complete("attn") == decode(expected["attn", 0])


def test_generate_loads_an_adapter_from_the_command_line(checkpoint, artifacts, adapters, capsys):
    """`generate --lora NAME=PATH --lora-name NAME` answers with the adapter: on an artifact with slots, and on the
    torch reference from the checkpoint, whose slots the adapter sizes; a malformed --lora is refused; `inspect`
    tells the artifact's slots."""
    for model, extra in ((artifacts["onnx"], []), (checkpoint, ["--backend", "torch"])):
        flags = ["--prompt", "Hi", "--raw", "--json", "--max-tokens", str(NEW_TOKENS), "--ignore-eos"]
        adapter = ["--lora", f"all={adapters['all']}", "--lora-name", "all"]
        assert main(["generate", str(model), *flags, *adapter, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        merged = adapters["all"].with_name("all-merged")
        assert out["token_ids"] == transformers_greedy(merged, out["prompt_token_ids"], NEW_TOKENS), model
    assert main(["generate", str(artifacts["onnx"]), "--prompt", "Hi", "--lora", "all"]) == 1
    assert "--lora 'all': expected NAME=PATH" in capsys.readouterr().err
    assert main(["inspect", str(artifacts["onnx"])]) == 0
    assert f"LoRA: {SLOTS} adapter slots of rank {RANK} on 14 linears" in capsys.readouterr().out
