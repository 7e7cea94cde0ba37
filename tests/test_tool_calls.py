"""Tool-call formats read from chat templates, the grammar that keeps calls valid, and the parser that splits a
reply into content and calls (runtime/tool_calls.py), on templates of the shapes model families use."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from llmlower.runtime.structured import GrammarCompiler, StructuredOutput
from llmlower.runtime.tokenizer import Tokenizer
from llmlower.runtime.tool_calls import GENERIC, ToolCallParser, generic_messages, tool_grammar
from llmlower.testing import CHATML, build_tokenizer

HERMES = (Path(__file__).parent / "data" / "hermes_tools.jinja").read_text()
# calls in one bracketed list after a special token, as Mistral-family templates write them
BRACKETED = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{% elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
# one call a turn as bare JSON with `parameters`, as Llama-3-family templates write it
SINGLE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% if m.tool_calls | length > 1 %}{{ raise_exception('one call at a time') }}{% endif %}"
    '{"name": "{{ m.tool_calls[0].function.name }}", "parameters": {{ m.tool_calls[0].function.arguments | tojson }}}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
)
# arguments written as Python's repr of a dict: not JSON, so not a format this reads
REPR = CHATML.replace("message['content']", "(message['content'] ~ (message.tool_calls or ''))")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FUNCTIONS = [("get_weather", WEATHER), ("add", {"type": "object", "properties": {"a": {"type": "integer"}}})]


def _tokenizer(template: str, special: tuple[str, ...] = ()) -> Tokenizer:
    """The tiny tokenizer with `template`, the markers of <tool_call> tags as tokens of their own (as Qwen-family
    tokenizers have them) and the `special` tokens."""
    built = build_tokenizer()
    built.add_tokens(["<tool_call>", "</tool_call>"])
    built.add_special_tokens(list(special))
    return Tokenizer(built.to_str(), {"eos_token": "<|im_end|>"}, template)


def test_formats_are_read_from_templates_of_each_shape():
    hermes = _tokenizer(HERMES).tool_format
    assert hermes.native and hermes.trigger == "<tool_call>"
    assert (hermes.head, hermes.name_to_args) == ('<tool_call>\n{"name": "', '", "arguments": ')
    assert (hermes.between, hermes.tail) == ('}\n</tool_call>\n<tool_call>\n{"name": "', "}\n</tool_call>")
    bracketed = _tokenizer(BRACKETED, ("[TOOL_CALLS]",)).tool_format
    assert bracketed.trigger == "[TOOL_CALLS]" and bracketed.head == '[TOOL_CALLS][{"name": "'
    assert (bracketed.between, bracketed.tail) == ('}, {"name": "', "}]")
    single = _tokenizer(SINGLE).tool_format
    assert single.trigger == '{"name": "' and single.name_to_args == '", "parameters": ' and single.between is None
    for template in (CHATML, REPR):
        assert _tokenizer(template).tool_format == GENERIC


@pytest.mark.parametrize("template", [HERMES, BRACKETED, SINGLE])
def test_a_call_as_the_template_writes_it_parses_and_passes_the_grammar(template):
    """The template's own rendering of a past call, with text before it: the parser (fed in pieces of every size)
    returns the text and the call, and the grammar of `auto` accepts every token of it."""
    tokenizer = _tokenizer(template, ("[TOOL_CALLS]",))
    format = tokenizer.tool_format
    arguments = {"city": 'Pa}r"is', "unit": "C"}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    user = [{"role": "user", "content": "hi"}]
    before = tokenizer.apply_chat_template(user, add_generation_prompt=False)
    after = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": "", "tool_calls": [call]}], add_generation_prompt=False
    )
    written = after[after.index(format.trigger, len(before) - 1) : after.rindex(format.tail) + len(format.tail)]
    reply = "Let me look. " + written
    for size in (1, 2, 5, len(reply)):
        parser = ToolCallParser(format)
        content = "".join(parser.feed(reply[i : i + size]) for i in range(0, len(reply), size)) + parser.finish()
        assert content == "Let me look. "
        assert [(c.name, json.loads(c.arguments)) for c in parser.complete_calls] == [("get_weather", arguments)]
    grammar = tool_grammar(format, FUNCTIONS, required=False, parallel=True, added_tokens=tokenizer.added_tokens())
    compiler = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, [tokenizer.vocabulary()["<|im_end|>"]])
    (constraint,) = compiler.constraints(StructuredOutput(grammar=grammar), 1)
    for token in tokenizer.encode(reply, add_special_tokens=False):
        constraint.accept(token)


def _sample(constraint, tokenizer: Tokenizer, seed: int, eos: int, limit: int = 400) -> str:
    """A reply drawn at random from the tokens the grammar allows (what a model of random weights would write)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(limit):
        mask = constraint.mask()
        allowed = [t for t in range(tokenizer.vocab_size) if (mask[t // 32] >> (t % 32)) & 1]
        token = int(rng.choice(allowed))
        if token == eos:
            break
        constraint.accept(token)
        ids.append(token)
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("template", [HERMES, BRACKETED, SINGLE, CHATML])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_drawn_at_random_always_validate(template, parallel):
    """tool_choice required: whatever tokens are drawn among those the grammar allows, the reply is calls of the
    offered functions whose arguments validate against their schemas (one call where parallel calls are off)."""
    tokenizer = _tokenizer(template, ("[TOOL_CALLS]",))
    format = tokenizer.tool_format
    grammar = tool_grammar(format, FUNCTIONS, required=True, parallel=parallel, added_tokens=tokenizer.added_tokens())
    eos = tokenizer.vocabulary()["<|im_end|>"]
    compiler = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, [eos])
    schemas = dict(FUNCTIONS)
    for seed in range(4):
        (constraint,) = compiler.constraints(StructuredOutput(grammar=grammar), 1)
        reply = _sample(constraint, tokenizer, seed, eos)
        parser = ToolCallParser(format)
        assert parser.feed(reply) + parser.finish() == ""
        assert parser.complete_calls and (parallel or len(parser.complete_calls) == 1)
        for call in parser.complete_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_generic_messages_describe_tools_and_write_past_calls():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = generic_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "1 + 2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "c"},
        ],
        tools,
    )
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    assert '{"name": "add", "parameters": {"type": "object"}}' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
