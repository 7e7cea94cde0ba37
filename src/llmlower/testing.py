"""Tiny random checkpoints of every architecture family llmlower supports, each saved as a checkpoint directory
with a small byte-level BPE tokenizer and a chat template: the models the tests, benchmarks and the GPU check
compile, and a starting point for anyone adding a family (add its config to TINY_CONFIGS)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    "bloom": lambda: transformers.BloomConfig(  # ALiBi, eager attention of its own
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.1
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


def write_tiny_checkpoint(arch: str, directory: Path, **config: object) -> Path:
    """A random `arch` model (its config changed by `config`) saved as a checkpoint directory with tokenizer
    files and a chat template."""
    torch.manual_seed(0)
    model_config = TINY_CONFIGS[arch]()
    types = getattr(model_config, "layer_types", None)
    if "num_hidden_layers" in config and types and "layer_types" not in config:  # one per layer (qwen2, qwen3)
        config = {**config, "layer_types": [types[0]] * config["num_hidden_layers"]}
    for name, value in config.items():
        setattr(model_config, name, value)
    model = transformers.AutoModelForCausalLM.from_config(model_config)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
