"""The runtime: executor interface, block manager, scheduler, tokenizer, sampler, detokenizer, engine. Imports
neither torch nor transformers."""

from .async_engine import AsyncEngine
from .engine import (
    Engine,
    EngineConfig,
    EngineStats,
    GenerationDelta,
    GenerationResult,
    Timing,
    TokenLogprob,
    Usage,
)
from .executor import Executor, PackedBatch, PaddedBatch, StepBatch, pack_batch, pad_batch, sequential_block_tables
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Executor",
    "GenerationDelta",
    "GenerationResult",
    "PackedBatch",
    "PaddedBatch",
    "SamplingParams",
    "StepBatch",
    "Timing",
    "TokenLogprob",
    "Tokenizer",
    "Usage",
    "pack_batch",
    "pad_batch",
    "sequential_block_tables",
]
