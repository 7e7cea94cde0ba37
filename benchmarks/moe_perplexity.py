"""Perplexity of a quantized mixture-of-experts model against fp32, on a MoE made from a real dense model.

No trained MoE checkpoint is available offline, so one is made from SmolLM2-135M-Instruct (`--model`, the example
checkpoint by default) by splitting its MLPs as MoEfication does (Zhang et al., 2022): each layer's 1536
intermediate neurons are clustered by co-activation into `--experts` experts of equal size (balanced k-means on
|activation| profiles over a calibration text), so each expert is a real slice of the trained MLP (its gate/up rows
and down columns). A router (Mixtral's: softmax, top-k, renormalised) is fitted by least squares to predict the norm
of each expert's output from the MLP's input, and scaled down so the renormalised weights of the k chosen experts
are 1/k within 0.05%; the down projections are multiplied by k, so the layer computes the sum of the experts the
router chose, the MLP restricted to their neurons. The choice matters, and costs: SwiGLU's neurons are not sparse
as ReLU's are (MoEfication's setting), so dropping any hurts. On the text's first 512 tokens (transformers, fp32):
all 8 experts reproduce the dense model (24.84), top 7 give 39.4, top 6 (the default) 62.2, top 4 442, top 2
31,427. (A spread of 0.05 instead doubled the top-8 perplexity: the weights' 5% deviations from 1/k add up.)
Attention, norms and embeddings are the dense model's. The calibration text is the documentation of Python's
standard library (never the scored text). The checkpoint is written with safetensors as a Mixtral (`--out`).

Then each pipeline's perplexity of `--text` is measured with the torch reference, as
`llmlower perplexity OUT --text FILE --quant QUANT` does, including the rows `--quant q4mix` was decided from.

    .venv/bin/python benchmarks/moe_perplexity.py --out /tmp/smollm2-moe [--model example] [--experts 8]
        [--top-k 6] [--text tests/data/perplexity.txt] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from quant_sensitivity import measure, print_table, with_overrides  # noqa: E402

from llmlower.frontend import example_checkpoint
from llmlower.passes import build_pipeline
from llmlower.passes.manager import PassSpec

CALIBRATION_MODULES = ("argparse", "collections", "dataclasses", "difflib", "functools", "itertools", "json")
CALIBRATION_MODULES += ("logging", "pathlib", "re", "statistics", "textwrap", "typing", "unittest", "email")
CALIBRATION_TOKENS, CHUNK = 8192, 512
LOGIT_SPREAD = 5e-4  # the router's logits' standard deviation: softmax weights of the chosen within ~0.05% of 1/k
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
QUANTS = ("q8", "q4g32", "q4g32-zp4", "q4g128-sym", "q4mix")


def calibration_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> torch.Tensor:
    """Token ids of the standard library's docstrings (modules, then their public members), CALIBRATION_TOKENS."""
    docs = []
    for name in CALIBRATION_MODULES:
        module = importlib.import_module(name)
        members = [getattr(module, m) for m in sorted(dir(module)) if not m.startswith("_")]
        docs += [inspect.getdoc(o) or "" for o in (module, *members)]
    ids = tokenizer("\n\n".join(d for d in dict.fromkeys(docs) if d))["input_ids"]
    if len(ids) < CALIBRATION_TOKENS:
        raise SystemExit(f"calibration text has {len(ids)} tokens, fewer than {CALIBRATION_TOKENS}")
    return torch.tensor(ids[:CALIBRATION_TOKENS])


def mlp_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's MLP input (the post-attention norm's output) over `ids`, in chunks of CHUNK tokens."""
    layers = model.model.layers
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[0]))
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for chunk in ids.split(CHUNK):
            model(chunk[None])
    for hook in hooks:
        hook.remove()
    return [torch.cat(chunks) for chunks in seen]


def balanced_clusters(features: np.ndarray, clusters: int, iterations: int = 15) -> list[np.ndarray]:
    """Rows of `features` (unit vectors) in `clusters` groups of equal size, by k-means whose assignment step
    fills each cluster to capacity with its most similar rows first."""
    rows = len(features)
    capacity = rows // clusters
    centroids = features[np.random.default_rng(0).choice(rows, clusters, replace=False)]
    for _ in range(iterations):
        similarity = features @ centroids.T
        owner, filled = np.full(rows, -1), np.zeros(clusters, int)
        for flat in np.argsort(-similarity, axis=None):
            row, cluster = divmod(int(flat), clusters)
            if owner[row] < 0 and filled[cluster] < capacity:
                owner[row], filled[cluster] = cluster, filled[cluster] + 1
        centroids = np.stack([features[owner == c].mean(0) for c in range(clusters)])
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return [np.flatnonzero(owner == c) for c in range(clusters)]


def split_mlp(mlp: torch.nn.Module, x: torch.Tensor, experts: int, top_k: int) -> tuple[dict, float]:
    """One layer's experts (Mixtral's fused tensors) and router from its dense MLP and MLP inputs `x` [n, H];
    also how often the router picks the experts with the largest outputs (its top-k set equal to theirs)."""
    w_gate, w_up, w_down = (p.weight.detach() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    with torch.no_grad():
        act = torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)  # [n, I]
    profiles = act.abs().T.double().numpy()
    profiles /= np.linalg.norm(profiles, axis=1, keepdims=True) + 1e-12
    groups = [torch.from_numpy(g) for g in balanced_clusters(profiles, experts)]
    outputs = torch.stack([(act[:, g] @ w_down[:, g].T).norm(dim=1) for g in groups], 1)  # [n, E]
    router = torch.linalg.lstsq(x.double(), outputs.double()).solution.T  # [E, H]
    logits = x.double() @ router.T
    router *= LOGIT_SPREAD / logits.std()
    chosen = logits.topk(top_k, dim=1).indices.sort(1).values
    best = outputs.topk(top_k, dim=1).indices.sort(1).values
    tensors = {
        "gate.weight": router.float(),
        "experts.gate_up_proj": torch.stack([torch.cat([w_gate[g], w_up[g]]) for g in groups]),
        "experts.down_proj": torch.stack([w_down[:, g] * top_k for g in groups]),
    }
    return tensors, float((chosen == best).all(1).double().mean())


def upcycle(model_dir: Path, out: Path, experts: int, top_k: int) -> list[float]:
    """Write the Mixtral made from the dense Llama at `model_dir` into `out`; returns each layer's router agreement
    with the largest experts on the calibration text."""
    dense = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    c = dense.config
    intermediate = c.intermediate_size // experts
    config = transformers.MixtralConfig(
        **{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")},
        **{k: getattr(c, k) for k in ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")},
        **{k: getattr(c, k) for k in ("rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")},
        intermediate_size=intermediate,
        tie_word_embeddings=c.tie_word_embeddings,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
    )
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    agreement = []
    for i, x in enumerate(mlp_inputs(dense, calibration_ids(tokenizer))):
        tensors, agree = split_mlp(dense.model.layers[i].mlp, x, experts, top_k)
        state |= {f"model.layers.{i}.mlp.{name}": t for name, t in tensors.items()}
        agreement.append(agree)
        print(f"[upcycle] layer {i}: router picks the largest {top_k} experts for {agree:.0%}", file=sys.stderr)
    moe = transformers.MixtralForCausalLM(config)
    moe.load_state_dict(state, strict=True)
    moe.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return agreement


def rows() -> dict[str, list[PassSpec]]:
    """Row label -> pipeline: fp32, each --quant, and the rows q4mix's experts were
    decided from (the experts' names are <module>.gate_up_proj and <module>.down_proj)."""
    table = {"fp32": build_pipeline(all_logits=True)}
    table |= {quant: build_pipeline(quant=quant, all_logits=True) for quant in QUANTS}
    for label, names in {
        "experts' gate/up": ("experts.gate_up_proj",),
        "experts' down": ("experts.down_proj",),
        "all experts": ("experts.",),
    }.items():
        table[f"q8, {label} q4g32-zp4"] = with_overrides("q8", names, "q4g32-zp4")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example", help="a dense Llama checkpoint directory, or example")
    parser.add_argument("--out", type=Path, required=True, help="where the MoE checkpoint is written (or reused)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--text", type=Path, default=Path(__file__).parent.parent / "tests/data/perplexity.txt")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    if not (args.out / "config.json").exists():
        model_dir = example_checkpoint() if args.model == "example" else Path(args.model)
        agreement = upcycle(model_dir, args.out, args.experts, args.top_k)
        print(f"[upcycle] router agreement, mean over layers: {np.mean(agreement):.0%}", file=sys.stderr)
    text = args.text.read_text(encoding="utf-8")
    results = measure(args.out, text, rows(), "moe perplexity")
    title = f"perplexity of {args.text.name} ({args.out.name}: {args.experts} experts, top {args.top_k})"
    print_table(results, title, "fp32", "quantized weight MB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
