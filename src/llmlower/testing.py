"""Tiny random checkpoints of every architecture family llmlower supports, each saved as a checkpoint directory
with a small byte-level BPE tokenizer and a chat template: the models the tests, benchmarks and the GPU check
compile, and a starting point for anyone adding a family (add its config to TINY_CONFIGS)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .passes.manager import PassSpec, pass_specs, pass_steps
from .passes.registry import PASSES

VOCAB = 320
BOS, EOS = 1, 4
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Compilers lower graphs to kernels; caches hold keys and values.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé, 東京, emoji 🙂 and numbers 12345.",
] * 20

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=BOS,
    eos_token_id=EOS,
    initializer_range=0.1,
)

# Gated DeltaNet's sizes: 2 key heads of 8 serving 4 value heads of 16, a conv of 4, attention in layer 1 of 4
GATED_DELTA = dict(
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)

# Mamba-2's sizes: 4 heads of 16 sharing one group of B and C, a state of 8, a conv of 4
MAMBA2 = dict(
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=1,
    mamba_chunk_size=8,
)

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=16, sliding_window=6),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),  # q/k/v projections with bias
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),  # q/k RMSNorm
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=16),
    # soft-capping that bends the logits (scale 1/2, not 1/sqrt(16); final logits capped too), alternating windows
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=4,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=5.0,
    ),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(  # softmax, top-k, renormalised
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(  # attention sinks, clamped SwiGLU experts with biases
        **COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(  # latent attention, grouped top-k routing, shared expert
        **{**COMMON, "num_key_value_heads": 4},
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
    # complex rotary on chunked local attention (chunks of 8), a last layer without rotary whose queries scale with
    # the position (attention temperature), experts (a shared one, sigmoid top-1) in every other layer
    "llama4": lambda: transformers.Llama4TextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.1,
    ),
    "bloom": lambda: transformers.BloomConfig(  # ALiBi, eager attention of its own
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.1
    ),
    "lfm2": lambda: transformers.Lfm2Config(  # hybrid: short-convolution layers (a conv state) around attention
        **{**COMMON, "num_hidden_layers": 3},
        layer_types=["conv", "full_attention", "conv"],
        block_auto_adjust_ff_dim=False,
    ),
    # hybrids: Gated DeltaNet layers (a conv state and a delta-rule state) around gated attention with partial rotary
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**{**COMMON, "num_hidden_layers": 4}, **GATED_DELTA),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(  # ... and experts with a shared expert
        **{**COMMON, "num_hidden_layers": 4},
        **GATED_DELTA,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    # a hybrid with Mamba layers (a conv state and a selective-scan state) between attention layers, and experts
    "jamba": lambda: transformers.JambaConfig(
        **{**COMMON, "num_hidden_layers": 4},
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_dt_rank=8,
    ),
    # hybrids with Mamba-2 layers (a conv state and an SSM state): beside attention and experts, ...
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **{**COMMON, "num_hidden_layers": 3},
        layer_types=["mamba", "attention", "mamba"],
        **MAMBA2,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
    ),
    # ... in a pattern with layers of an MLP alone (no mixer), ...
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **{**COMMON, "num_hidden_layers": 4},
        hybrid_override_pattern="M*M-",
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=8,
        conv_kernel=4,
        expand=1,
        chunk_size=8,
    ),
    # ... in parallel with attention in every layer, ...
    "falcon_h1": lambda: transformers.FalconH1Config(**COMMON, **MAMBA2, head_dim=16, mamba_d_ssm=64),
    # ... and alone (no attention, no KV cache)
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=16,
        n_groups=1,
        state_size=8,
        expand=1,
        conv_kernel=4,
        chunk_size=8,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=0,
        initializer_range=0.1,
    ),
    "gpt2": lambda: transformers.GPT2Config(  # learned positions, MHA, Conv1D
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=BOS,
        eos_token_id=EOS,
        initializer_range=0.1,
    ),
}


def layer_types_settable(config: transformers.PretrainedConfig) -> bool:
    """Whether a config's layer_types is a field of its own, not a property computed from others (Mamba-2's,
    Falcon-H1's), which a checkpoint with fewer layers cannot be given."""
    name = config.attribute_map.get("layer_types", "layer_types")
    return not isinstance(getattr(type(config), name, None), property)


def transformers_greedy(checkpoint: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own model, greedy, with no cache and no stop token: the argmax of each step's last logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of VOCAB tokens trained on TRAINING_TEXT, with ChatML's special tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


def write_tiny_checkpoint(
    arch: str, directory: Path, factory: Callable[[], transformers.PretrainedConfig] | None = None, **config: object
) -> Path:
    """A random `arch` model (its config changed by `config`; made by `factory` for a family outside TINY_CONFIGS)
    saved as a checkpoint directory with tokenizer files and a chat template."""
    torch.manual_seed(0)
    model_config = (factory or TINY_CONFIGS[arch])()
    types = getattr(model_config, "layer_types", None) if layer_types_settable(model_config) else None
    if "num_hidden_layers" in config and types and "layer_types" not in config:  # one per layer, the pattern repeated
        config = {**config, "layer_types": [types[i % len(types)] for i in range(config["num_hidden_layers"])]}
    for name, value in config.items():
        setattr(model_config, name, value)
    model = transformers.AutoModelForCausalLM.from_config(model_config)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# llama.cpp's names of a Llama checkpoint's tensors (per layer: blk.N.<name>)
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(checkpoint: Path, path: Path) -> Path:
    """A tiny Llama checkpoint (write_tiny_checkpoint's) as a GGUF file the way llama.cpp writes one: its
    metadata and BPE tokenizer, matrices in Q4_1 blocks, q and k rows in llama.cpp's rotary order."""
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(config["head_dim"])
    vocab = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    special = {token["content"] for token in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges([" ".join(merge) for merge in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(CHATML)
    names = dict(GGUF_NAMES)
    for layer in range(config["num_hidden_layers"]):
        names |= {f"model.layers.{layer}.{name}.weight": f"blk.{layer}.{gg}" for name, gg in GGUF_LAYER_NAMES.items()}
    weights = load_file(str(checkpoint / "model.safetensors"))
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    for name, gg in names.items():
        weight = weights[name].astype(np.float32)
        if gg.endswith(("attn_q", "attn_k")):  # each head's rotary halves interleaved, as llama.cpp keeps them
            n = heads if gg.endswith("attn_q") else kv_heads
            weight = weight.reshape(n, 2, -1, weight.shape[1]).swapaxes(1, 2).reshape(weight.shape)
        if weight.ndim == 2:
            writer.add_tensor(f"{gg}.weight", gguf.quants.quantize(weight, q4_1), raw_dtype=q4_1)
        else:
            writer.add_tensor(f"{gg}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def calibrated(pipeline: Sequence[PassSpec]) -> list[PassSpec]:
    """The pipeline with each calibrated pass (awq, smoothquant, kv_cache_dtype) given made-up token ids below
    VOCAB where its options have none: what a compile does with its calibration text, for pipelines run on
    captured programs."""
    steps = pass_steps(pipeline)
    for name, options in steps:
        if PASSES[name].calibrated:
            options.setdefault("calibration", [5 + (7 * i) % (VOCAB - 5) for i in range(96)])
    return pass_specs(steps)
