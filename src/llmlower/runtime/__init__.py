"""The runtime: executor interface, block manager, scheduler, tokenizer, sampler, detokenizer, engine. Imports
neither torch nor transformers."""

from .async_engine import AsyncEngine
from .engine import Engine, EngineConfig
from .engine_core import EngineStats
from .executor import Executor, PackedBatch, PaddedBatch, StepBatch, pack_batch, pad_batch, sequential_block_tables
from .outputs import GenerationDelta, GenerationResult, Timing, TokenLogprob, Usage
from .sampling_params import SamplingParams
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
