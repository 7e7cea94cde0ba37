"""Reasoning markers read from chat templates, and replies split into reasoning and content as their text arrives
(runtime/reasoning.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmlower.runtime.reasoning import ReasoningFormat, ReasoningParser, find_reasoning
from llmlower.runtime.tokenizer import Tokenizer
from llmlower.testing import CHATML, build_tokenizer

HERMES = (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
# every answer starts thinking: the generation prompt opens the block (as DeepSeek-R1-family templates do)
OPENS = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<thinking>\n'") + "{# </thinking> #}"
THINK = ReasoningFormat("<think>", "</think>")


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(build_tokenizer().to_str(), {"eos_token": "<|im_end|>"}, template)


def test_markers_and_whether_the_prompt_opens_them_come_from_the_template():
    qwen_like = _tokenizer(HERMES)
    assert qwen_like.reasoning_format == THINK
    assert not THINK.opened_by(qwen_like.generation_prompt())
    assert qwen_like.generation_prompt(enable_thinking=False) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert not THINK.opened_by(qwen_like.generation_prompt(enable_thinking=False))
    opens = _tokenizer(OPENS)
    assert opens.reasoning_format == ReasoningFormat("<thinking>", "</thinking>")
    assert opens.reasoning_format.opened_by(opens.generation_prompt())
    assert _tokenizer(CHATML).reasoning_format is None and find_reasoning(None) is None


def _split(parser: ReasoningParser, reply: str, size: int) -> tuple[str, str]:
    pieces = [parser.feed(reply[i : i + size]) for i in range(0, len(reply), size)] + [parser.finish()]
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    ("reply", "inside", "expected"),
    [
        ("<think>\nLet me see: 2 < 3.\n</think>\n\nThree.", False, ("\nLet me see: 2 < 3.\n", "Three.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("No thinking, <think> in the middle.", False, ("", "No thinking, <think> in the middle.")),
        ("<thi", False, ("", "<thi")),  # a start that never came is content
        ("still thinking", True, ("still thinking", "")),
        ("done </think> answer </think>", True, ("done ", "answer </think>")),
        ("", False, ("", "")),
    ],
)
def test_a_reply_fed_in_pieces_of_any_size_splits_the_same(reply, inside, expected, size):
    assert _split(ReasoningParser(THINK, inside), reply, size) == expected
