"""The runtime: executor interface, tokenizer, sampler, detokenizer, engine. Imports neither torch nor
transformers."""

from .async_engine import AsyncEngine
from .engine import Engine, GenerationDelta, GenerationResult, Timing, TokenLogprob, Usage
from .executor import Executor, PaddedBatch, StepBatch, pad_batch
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = [
    "AsyncEngine",
    "Engine",
    "Executor",
    "GenerationDelta",
    "GenerationResult",
    "PaddedBatch",
    "SamplingParams",
    "StepBatch",
    "Timing",
    "TokenLogprob",
    "Tokenizer",
    "Usage",
    "pad_batch",
]
