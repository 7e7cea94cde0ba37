"""Load a transformers checkpoint directory or a GGUF file into transformers' own torch module + ModelSpec."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..errors import CheckpointError
from ..progress import stage
from ..spec import DTYPE_BYTES, ModelSpec
from .attention_capture import attn_implementation
from .experts_capture import EXPERTS_IMPLEMENTATION, prepare_experts
from .files import check_chat_template, check_gguf, read_json, read_tokenizer_json, safetensors_shards

CHAT_TEMPLATE_FILE = "chat_template.jinja"
POSITION_LIMITS = ("max_position_embeddings", "seq_length", "max_seq_len")  # the configs' names, most common first
UNLIMITED_POSITIONS = 2048  # BLOOM's training length: the context of a model whose positions have no limit


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer as the runtime reads it: tokenizer.json text, tokenizer_config.json, chat template."""

    tokenizer_json: str
    config: dict[str, Any]
    chat_template: str | None = None

    def write(self, directory: Path) -> None:
        (directory / "tokenizer.json").write_text(self.tokenizer_json, encoding="utf-8")
        config = dict(self.config)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


@dataclass
class LoadedModel:
    """A model ready to capture: transformers' module (eval mode), its spec, tokenizer and origin."""

    module: torch.nn.Module
    spec: ModelSpec
    tokenizer: TokenizerFiles
    source: Path
    num_parameters: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_parameters = sum(p.numel() for p in self.module.parameters())


def load(path: str | Path, dtype: str = "float32") -> LoadedModel:
    """Load a checkpoint directory (config.json, *.safetensors, tokenizer files) or a .gguf file."""
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPE_BYTES)})")
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if (path / "manifest.json").is_file():
        raise CheckpointError(
            f"{path}: a compiled llmlower artifact, not a checkpoint (generate, chat, serve, perplexity and "
            "inspect take artifacts; compile takes the checkpoint it was compiled from)"
        )
    with stage(f"load {path}"):
        loaded = _load_directory(path, dtype) if path.is_dir() else _load_gguf(path, dtype)
    loaded.module.eval().requires_grad_(False)
    prepare_experts(loaded.module)
    return loaded


def _load_directory(directory: Path, dtype: str) -> LoadedModel:
    config_path = directory / "config.json"
    raw_config = read_json(config_path)
    model_type = raw_config.get("model_type")
    if not model_type:
        raise CheckpointError(f"{config_path}: field 'model_type' is missing")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not known to transformers {transformers.__version__}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(f"{config_path}: model_type {model_type!r} has no causal-LM class in transformers")
    safetensors_shards(directory)
    tokenizer = _tokenizer_files(directory)
    try:
        config = AutoConfig.from_pretrained(directory)
        attention = attn_implementation(config)
        module = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=getattr(torch, dtype),
            attn_implementation=attention,
            experts_implementation=EXPERTS_IMPLEMENTATION,
            use_safetensors=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{directory}: transformers could not load the checkpoint: {exc}") from None
    generation = read_json(directory / "generation_config.json", required=False) or {}
    # the config the causal LM was built with: a multimodal checkpoint's (Llama 4, Qwen3.5) holds its text model's
    spec = spec_from_config(module.config, generation, tokenizer, dtype)
    return LoadedModel(module, replace(spec, architecture=type(module).__name__), tokenizer, directory)


def _tokenizer_files(directory: Path) -> TokenizerFiles:
    """tokenizer.json, tokenizer_config.json and the chat template, each checked here (a malformed one names its
    file now, not when an artifact built from it is loaded)."""
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(f"{tokenizer_path}: not found (the runtime needs a fast tokenizer's tokenizer.json)")
    tokenizer_json = read_tokenizer_json(tokenizer_path)
    config_path = directory / "tokenizer_config.json"
    config = read_json(config_path, required=False) or {}
    template = config.pop("chat_template", None)
    if isinstance(template, list):  # named templates: use the default one
        named = (t for t in template if isinstance(t, dict) and t.get("name") == "default")
        template = next((t.get("template") for t in named), None)
    template_source = config_path
    template_path = directory / CHAT_TEMPLATE_FILE
    if template_path.is_file():
        try:
            template = template_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{template_path}: not UTF-8 text ({exc})") from None
        template_source = template_path
    if template is not None:
        check_chat_template(template, template_source)
    return TokenizerFiles(tokenizer_json, config, template)


def _load_gguf(path: Path, dtype: str) -> LoadedModel:
    check_gguf(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        module = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=getattr(torch, dtype),
            attn_implementation="sdpa",
            experts_implementation=EXPERTS_IMPLEMENTATION,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: transformers could not load this GGUF file: {exc}") from None
    # Dequantized on load: the module holds plain weights, so it is no longer a "quantized" model.
    module.hf_quantizer = None
    del module.config.quantization_config
    special = {name: str(value) for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}
    files = TokenizerFiles(tokenizer.backend_tokenizer.to_str(), special, tokenizer.chat_template)
    spec = spec_from_config(module.config, module.generation_config.to_dict(), files, dtype)
    return LoadedModel(module, spec, files, path)


def spec_from_config(
    config: transformers.PretrainedConfig, generation: dict[str, Any], tokenizer: TokenizerFiles, dtype: str
) -> ModelSpec:
    """ModelSpec from a transformers config (attribute maps make GPT-2's n_layer etc. read the same)."""
    # a model without attention (Mamba-2) has no attention heads: its SSM heads stand in (no KV cache reads them)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None) or 1
    hidden = config.hidden_size
    layer_types = getattr(config, "layer_types", None)
    rope = getattr(config, "rope_parameters", None)
    return ModelSpec(
        architecture=(config.architectures or [type(config).__name__.replace("Config", "ForCausalLM")])[0],
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        hidden_size=hidden,
        intermediate_size=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        vocab_size=config.vocab_size,
        max_positions=_max_positions(config),
        dtype=dtype,
        rope=dict(rope) if rope else None,
        sliding_window=getattr(config, "sliding_window", None),
        attention_chunk_size=getattr(config, "attention_chunk_size", None),
        layer_types=tuple(layer_types) if layer_types else None,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=_first(generation.get("bos_token_id"), config.bos_token_id),
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), config.eos_token_id),
        pad_token_id=_first(generation.get("pad_token_id"), getattr(config, "pad_token_id", None)),
        chat_template=tokenizer.chat_template,
    )


def _max_positions(config: transformers.PretrainedConfig) -> int:
    """The longest context the model was made for: max_position_embeddings, or the training length some configs
    give instead (seq_length, max_seq_len). Positions without a trained limit (ALiBi: Bloom's config names none)
    get UNLIMITED_POSITIONS, the context an artifact is then compiled for; the runtime's max_context caps it."""
    for name in POSITION_LIMITS:
        positions = getattr(config, name, None)
        if positions is not None:
            return int(positions)
    return UNLIMITED_POSITIONS


def _first(*values: Any) -> int | None:
    return next((int(v) for v in values if v is not None), None)


def _eos_ids(*values: Any) -> tuple[int, ...]:
    """The union of eos ids from the generation config and the model config, generation config first."""
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def save_checkpoint(model: LoadedModel, directory: Path) -> Path:
    """Write `model` as a checkpoint directory (safetensors weights); complete or not at all."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with stage(f"write checkpoint {directory}"):
            model.module.save_pretrained(staging, safe_serialization=True)
            model.tokenizer.write(staging)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
