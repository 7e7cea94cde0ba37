"""Sampling parameters: how one request's tokens are chosen and when it stops (SamplingParams), validated on
construction so that a bad field fails the request before it reaches a step, with a GenerationError naming it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import GenerationError
from .structured import StructuredOutput


def _fail(name: str, value: object, expected: str) -> GenerationError:
    """The one error every bad field gets: its name, what it must be, and what it was."""
    return GenerationError(f"{name} must be {expected}, got {value!r}", name.partition("[")[0])


def _is_int(value: object) -> bool:
    """True for Python and numpy integers but not bools, which are ints to Python yet never meant as counts here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int) -> int:
    """`value` as an int >= low, or a GenerationError naming `name`."""
    if not _is_int(value) or value < low:
        raise _fail(name, value, f"an int >= {low}")
    return int(value)


def _check_real(name: str, value: object, interval: str) -> float:
    """`value` as a finite float in `interval`, written like "(0, 1]", or a GenerationError naming `name`."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    above = finite and (value > low if interval[0] == "(" else value >= low)
    below = finite and (value < high if interval[-1] == ")" else value <= high)
    if not (above and below):
        raise _fail(name, value, f"a finite number in {interval}")
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool, else a GenerationError naming `name`."""
    if not isinstance(value, bool):
        raise _fail(name, value, "a bool")
    return value


def _check_stop(value: object) -> tuple[str, ...]:
    """Stop strings as a tuple: None, a str, or a list or tuple of non-empty str."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise _fail("stop", value, "a non-empty str or a list of non-empty str")
    return tuple(value)


def _check_token_ids(value: object) -> tuple[int, ...]:
    """Stop token ids as a tuple: None, or a list or tuple of ints >= 0."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise _fail("stop_token_ids", value, "a list of ints >= 0")
    return tuple(int(t) for t in value)


def _check_logit_bias(value: object) -> dict[int, float]:
    """Logit bias as a dict of token id (int >= 0) to a bias in [-100, 100], as in the OpenAI API."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail("logit_bias", value, "a dict of token id to bias")
    for token, bias in value.items():
        if not _is_int(token) or token < 0:
            raise _fail("logit_bias", value, f"a dict with int token ids >= 0 as keys (key {token!r})")
        _check_real(f"logit_bias[{token}]", bias, "[-100, 100]")
    return {int(token): float(bias) for token, bias in value.items()}


def _check_structured_output(value: object) -> StructuredOutput | None:
    """None or a StructuredOutput (which checked its own fields)."""
    if value is not None and not isinstance(value, StructuredOutput):
        raise _fail("structured_output", value, "a StructuredOutput or None")
    return value


def _check_lora(value: object) -> str | None:
    """None or an adapter's name (a non-empty str)."""
    if value is not None and not (isinstance(value, str) and value):
        raise _fail("lora", value, "None or a LoRA adapter's name")
    return value


GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as in vLLM)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops; defaults as in vLLM, validated on construction."""

    temperature: float = 1.0  # >= 0; 0 (or below GREEDY_BELOW) is greedy
    top_p: float = 1.0  # (0, 1]; 1 is off
    top_k: int = 0  # >= 1 keeps that many tokens; 0 or -1 is off
    min_p: float = 0.0  # [0, 1]; 0 is off
    repetition_penalty: float = 1.0  # > 0; 1 is off
    frequency_penalty: float = 0.0  # [-2, 2]
    presence_penalty: float = 0.0  # [-2, 2]
    logit_bias: dict[int, float] | None = field(default_factory=dict)  # token id -> bias in [-100, 100]
    seed: int | None = None  # >= 0: the request draws from its own generator
    max_tokens: int = 16  # >= 1
    min_tokens: int = 0  # [0, max_tokens]: EOS and stop_token_ids are masked until this many tokens exist
    stop: str | Sequence[str] | None = ()  # stored as a tuple of non-empty str
    stop_token_ids: Sequence[int] | None = ()  # stored as a tuple
    ignore_eos: bool = False
    logprobs: bool = False  # report the chosen token's logprob
    top_logprobs: int = 0  # >= 0: also report this many most likely tokens (needs logprobs)
    n: int = 1  # >= 1 completions of the prompt
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # special tokens left out of the text (tool-call markers may be special)
    structured_output: StructuredOutput | None = None  # a JSON schema, any JSON object, a regex or a grammar
    lora: str | None = None  # the LoRA adapter that answers, by the name it was loaded under; None: the base model

    def __post_init__(self) -> None:
        """Check every field, raising a GenerationError that names the first bad one; normalise types."""
        checked = {
            "temperature": _check_real("temperature", self.temperature, "[0, inf)"),
            "top_p": _check_real("top_p", self.top_p, "(0, 1]"),
            "top_k": _check_int("top_k", self.top_k, -1),
            "min_p": _check_real("min_p", self.min_p, "[0, 1]"),
            "repetition_penalty": _check_real("repetition_penalty", self.repetition_penalty, "(0, inf)"),
            "frequency_penalty": _check_real("frequency_penalty", self.frequency_penalty, "[-2, 2]"),
            "presence_penalty": _check_real("presence_penalty", self.presence_penalty, "[-2, 2]"),
            "logit_bias": _check_logit_bias(self.logit_bias),
            "seed": None if self.seed is None else _check_int("seed", self.seed, 0),
            "max_tokens": _check_int("max_tokens", self.max_tokens, 1),
            "min_tokens": _check_int("min_tokens", self.min_tokens, 0),
            "stop": _check_stop(self.stop),
            "stop_token_ids": _check_token_ids(self.stop_token_ids),
            "ignore_eos": _check_bool("ignore_eos", self.ignore_eos),
            "logprobs": _check_bool("logprobs", self.logprobs),
            "top_logprobs": _check_int("top_logprobs", self.top_logprobs, 0),
            "n": _check_int("n", self.n, 1),
            "include_stop_str_in_output": _check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
            "skip_special_tokens": _check_bool("skip_special_tokens", self.skip_special_tokens),
            "structured_output": _check_structured_output(self.structured_output),
            "lora": _check_lora(self.lora),
        }
        if checked["min_tokens"] > checked["max_tokens"]:
            raise _fail("min_tokens", self.min_tokens, f"<= max_tokens ({checked['max_tokens']})")
        if checked["top_logprobs"] and not checked["logprobs"]:
            raise _fail("top_logprobs", self.top_logprobs, "0 unless logprobs is True")
        if checked["temperature"] < GREEDY_BELOW:  # dividing by it would overflow the logits into NaN weights
            checked["temperature"] = 0.0
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax is taken and nothing is drawn."""
        return self.temperature == 0.0
