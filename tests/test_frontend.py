"""Loading checkpoints: ModelSpec contents, and a clear error naming the file for each kind of bad input."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from llmlower.api import tokenizer_of
from llmlower.cli import main
from llmlower.errors import CheckpointError
from llmlower.frontend import load
from llmlower.testing import write_tiny_gguf


def test_spec_from_checkpoint(tiny_checkpoints):
    spec = load(tiny_checkpoints["llama"]).spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.max_positions) == (
        64,
        128,
        320,
        128,
    )
    assert spec.eos_token_ids == (4,) and spec.bos_token_id == 1
    assert spec.rope["rope_theta"] == 10000.0
    assert "<|im_start|>" in spec.chat_template
    assert spec.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_spec_of_gpt2_uses_its_config_names(tiny_checkpoints):
    spec = load(tiny_checkpoints["gpt2"]).spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.intermediate_size) == (2, 4, 4, 256)
    assert spec.rope is None


def test_mistral_window_applies_to_every_layer(tiny_checkpoints):
    spec = load(tiny_checkpoints["mistral"]).spec
    assert [spec.window_for_layer(i) for i in range(spec.num_layers)] == [6, 6]


def test_llama4_layers_take_chunks_and_its_nope_layer_all_positions(tiny_checkpoints):
    spec = load(tiny_checkpoints["llama4"]).spec
    assert [spec.window_for_layer(i) for i in range(spec.num_layers)] == [-8, -8, -8, 0]


def test_a_multimodal_checkpoint_loads_its_language_model(tiny_checkpoints, tmp_path):
    """Llama 4 (and Qwen3.5) are published as image + text models: their config nests the text model's, and the
    compiled model is the causal LM transformers builds from it, with the checkpoint's language weights."""
    import transformers
    from safetensors.torch import load_file

    text = transformers.AutoConfig.from_pretrained(tiny_checkpoints["llama4"])
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
        patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
    )  # fmt: skip
    config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    directory = _copy(tiny_checkpoints["llama4"], tmp_path)
    transformers.Llama4ForConditionalGeneration(config).save_pretrained(directory)
    loaded = load(directory)
    assert (loaded.spec.architecture, loaded.spec.hidden_size, loaded.spec.num_layers) == ("Llama4ForCausalLM", 64, 4)
    assert loaded.spec.window_for_layer(0) == -8
    saved = load_file(directory / "model.safetensors")["language_model.model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(loaded.module.model.layers[0].self_attn.q_proj.weight, saved)


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "ckpt")


def _assert_cli_error(path, capsys, *needles):
    code = main(["inspect", str(path)])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_directory_without_config(tiny_llama, tmp_path, capsys):
    ckpt = _copy(tiny_llama, tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load(ckpt)
    _assert_cli_error(ckpt, capsys, "config.json", "not found")


def test_unknown_model_type(tiny_llama, tmp_path, capsys):
    ckpt = _copy(tiny_llama, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama_from_the_future"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type 'llama_from_the_future' is not known"):
        load(ckpt)
    _assert_cli_error(ckpt, capsys, "config.json", "llama_from_the_future")


def test_malformed_config_json(tiny_llama, tmp_path):
    ckpt = _copy(tiny_llama, tmp_path)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load(ckpt)


def test_truncated_safetensors(tiny_llama, tmp_path, capsys):
    ckpt = _copy(tiny_llama, tmp_path)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated safetensors file"):
        load(ckpt)
    _assert_cli_error(ckpt, capsys, "model.safetensors", "truncated")


def test_pickle_weights_are_refused(tiny_llama, tmp_path):
    ckpt = _copy(tiny_llama, tmp_path)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickle files are never loaded"):
        load(ckpt)


def test_file_that_is_not_gguf(tmp_path, capsys):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF file")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load(bogus)
    _assert_cli_error(bogus, capsys, "model.gguf", "not a GGUF file")


def test_missing_path(tmp_path, capsys):
    _assert_cli_error(tmp_path / "nowhere", capsys, "nowhere", "no such file or directory")


def test_a_gguf_file_loads_dequantized_in_the_asked_dtype(tiny_llama, tmp_path):
    """The tiny Llama as llama.cpp writes a GGUF file (Q4_1 matrices, q and k rows in its rotary order): in float32
    every weight is the checkpoint's on the Q4_1 grid, in transformers' order; in float16 the same weights cast;
    the spec, the tokenizer and the chat template are the checkpoint's."""
    path = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf")
    fp32, fp16, checkpoint = load(path), load(path, dtype="float16"), load(tiny_llama)
    assert fp32.spec == checkpoint.spec and fp16.spec == replace(checkpoint.spec, dtype="float16")
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    reference = {name: weight.detach().numpy() for name, weight in checkpoint.module.named_parameters()}
    loaded = dict(fp32.module.named_parameters())
    assert set(loaded) == set(reference)
    for name, weight in loaded.items():
        expected = reference[name]
        if expected.ndim == 2:
            expected = gguf.quants.dequantize(gguf.quants.quantize(expected, q4_1), q4_1)
        assert np.array_equal(weight.detach().numpy(), expected), name
    for name, weight in fp16.module.named_parameters():
        assert weight.dtype == torch.float16 and torch.equal(weight, loaded[name].half()), name
    text = "The quick brown fox, 東京 🙂 and 12345."
    assert tokenizer_of(fp32).encode(text) == tokenizer_of(checkpoint).encode(text)
    assert fp32.tokenizer.chat_template == checkpoint.tokenizer.chat_template
