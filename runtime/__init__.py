"""The runtime: executor interface, tokenizer, decode loop. Imports neither torch nor transformers."""

from .engine import Engine, GenerationResult, Timing
from .executor import Executor, PaddedBatch, StepBatch, pad_batch
from .tokenizer import Tokenizer

__all__ = [
    "Engine",
    "Executor",
    "GenerationResult",
    "PaddedBatch",
    "StepBatch",
    "Timing",
    "Tokenizer",
    "pad_batch",
]
