"""Perplexity of a quantized hybrid model against fp32, on a hybrid distilled from a real dense model.

No trained hybrid checkpoint is available offline, so one is distilled from SmolLM2-135M-Instruct (`--model`, the
example checkpoint by default), as attention is linearized into recurrent layers (Mamba-in-the-Llama, LoLCATs): a
Bamba (Mamba-2 beside attention) of SmolLM2's shape keeps SmolLM2's embeddings, norms, MLPs and every
`--attention-every`-th layer's attention (every other layer by default, as in Jamba-style hybrids; 4 gives Qwen3.5's
three recurrent layers to one, with more error to distill away), and each other layer's attention becomes a Mamba-2
mixer trained to reproduce it: its input the layer's normed hidden states over a calibration text, its target that
layer's attention output, `--steps` Adam steps of relative squared error each. Layer by layer, no end-to-end tuning:
the errors add up, so the hybrid is a weaker model than SmolLM2, but its recurrent weights are trained ones (what
quantization error depends on), not random. The calibration text is the documentation of Python's standard library
(never the scored text). The checkpoint is written with safetensors as a Bamba (`--out`).

Then each pipeline's perplexity of `--text` is measured with the torch reference, as `llmlower perplexity OUT --text
FILE --quant QUANT [--gptq]` does, beside transformers' own fp32 perplexity of the same checkpoint.

    .venv/bin/python benchmarks/hybrid_perplexity.py --out /tmp/smollm2-hybrid [--model example]
        [--attention-every 2] [--steps 120] [--text tests/data/perplexity.txt] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from moe_perplexity import TOKENIZER_FILES, calibration_ids  # noqa: E402
from quant_sensitivity import measure, print_table  # noqa: E402

from llmlower.frontend import example_checkpoint
from llmlower.passes import build_pipeline
from llmlower.runtime.perplexity import perplexity

CHUNK, BATCH = 256, 2  # calibration sequences of CHUNK tokens, BATCH of them per training step
MAMBA = {"mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
QUANTS = ("q8", "q4g32", "q4g32-zp4", "q4g128-sym", "q4mix")
GPTQ_QUANTS = ("q4g32-sym", "q4g128-sym", "q4mix")  # also with GPTQ (its own calibration text) in quantize's place
SEED = 0


def hybrid_config(dense: transformers.PretrainedConfig, attention: list[int]) -> transformers.BambaConfig:
    """A Bamba of the dense Llama's shape with attention at the `attention` layers, Mamba-2 elsewhere."""
    copied = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    copied += ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    copied += ("bos_token_id", "eos_token_id", "pad_token_id")
    heads = MAMBA["mamba_expand"] * dense.hidden_size // MAMBA["mamba_d_head"]
    rope = {"rope_type": "default", "rope_theta": dense.rope_parameters["rope_theta"], "partial_rotary_factor": 1.0}
    return transformers.BambaConfig(
        **{k: getattr(dense, k) for k in copied},
        attn_layer_indices=attention,
        mamba_n_heads=heads,
        mamba_chunk_size=128,
        rope_parameters=rope,
        **MAMBA,
    )


def attention_io(model: torch.nn.Module, ids: torch.Tensor, layers: list[int]) -> dict[int, tuple]:
    """Each of `layers`' attention input (the normed hidden states) and output over `ids`, [sequences, CHUNK,
    hidden] each."""
    seen: dict[int, tuple[list, list]] = {i: ([], []) for i in layers}
    hooks = []
    for i in layers:
        layer = model.model.layers[i]
        hooks.append(layer.input_layernorm.register_forward_hook(lambda m, a, out, i=i: seen[i][0].append(out)))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen[i][1].append(out[0])))
    with torch.no_grad():
        for chunk in ids[: len(ids) // CHUNK * CHUNK].view(-1, CHUNK):
            model(chunk[None])
    for hook in hooks:
        hook.remove()
    return {i: (torch.cat(x), torch.cat(y)) for i, (x, y) in seen.items()}


def distill(mixer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Train `mixer` to map x to y (relative squared error, Adam); returns the last steps' mean error."""
    optimizer = torch.optim.Adam(mixer.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(SEED)
    scale = y.pow(2).mean()
    errors = []
    for _ in range(steps):
        rows = torch.randint(len(x), (BATCH,), generator=generator)
        loss = (mixer(x[rows]) - y[rows]).pow(2).mean() / scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        errors.append(loss.item())
    return sum(errors[-10:]) / len(errors[-10:])


def linearize(model_dir: Path, out: Path, every: int, steps: int) -> None:
    """Write the hybrid distilled from the dense Llama at `model_dir` into `out`."""
    torch.manual_seed(SEED)
    dense = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    layers = dense.config.num_hidden_layers
    attention = [i for i in range(layers) if i % every == every - 1]
    recurrent = [i for i in range(layers) if i not in attention]
    hybrid = transformers.BambaForCausalLM(hybrid_config(dense.config, attention)).float()
    renames = {"mlp.": "feed_forward.", "post_attention_layernorm": "pre_ff_layernorm"}
    renames["model.norm."] = "model.final_layernorm."
    state = hybrid.state_dict()
    for name, tensor in dense.state_dict().items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer in recurrent and ".self_attn." in name:
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    hybrid.load_state_dict(state, strict=True)
    io = attention_io(dense, calibration_ids(tokenizer), recurrent)
    for i in recurrent:
        start = time.perf_counter()
        error = distill(hybrid.model.layers[i].mamba, *io.pop(i), steps)
        print(f"[distill] layer {i}: relative error {error:.3f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    hybrid.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)


def transformers_perplexity(model_dir: Path, text: str) -> float:
    """transformers' own fp32 perplexity of `text` under the checkpoint, in the same sliding windows as
    `llmlower perplexity` (512 tokens, stride 256): the fp32 row's reference."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    return perplexity(logits, tokenizer.encode(text, add_special_tokens=False), window=512, stride=256).perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example", help="a dense Llama checkpoint directory, or example")
    parser.add_argument("--out", type=Path, required=True, help="where the hybrid checkpoint is written (or reused)")
    parser.add_argument("--attention-every", type=int, default=2, help="keep every Nth layer's attention")
    parser.add_argument("--steps", type=int, default=120, help="training steps per recurrent layer")
    parser.add_argument("--text", type=Path, default=Path(__file__).parent.parent / "tests/data/perplexity.txt")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    if not (args.out / "config.json").exists():
        model_dir = example_checkpoint() if args.model == "example" else Path(args.model)
        linearize(model_dir, args.out, args.attention_every, args.steps)
    text = args.text.read_text(encoding="utf-8")
    table = {"fp32": build_pipeline(all_logits=True)}
    table |= {quant: build_pipeline(quant=quant, all_logits=True) for quant in QUANTS}
    table |= {f"{quant} gptq": build_pipeline(quant=quant, gptq=True, all_logits=True) for quant in GPTQ_QUANTS}
    results = measure(args.out, text, table, "hybrid perplexity")
    reference = transformers_perplexity(args.out, text)
    print(f"transformers' fp32 perplexity of the checkpoint: {reference:.2f}")
    print_table(results, f"perplexity of {args.text.name} ({args.out.name})", "fp32", "quantized weight MB")
    if args.json:
        args.json.write_text(json.dumps({"transformers": reference, **results}, indent=2))


if __name__ == "__main__":
    main()
