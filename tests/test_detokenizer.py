"""Streaming detokenization: no broken characters, deltas that add up to the full decode, and stop handling."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers

from llmlower.errors import GenerationError
from llmlower.runtime.detokenizer import IncrementalDetokenizer, StreamDelta, TextStream, eos_token_ids
from llmlower.runtime.tokenizer import Tokenizer

TEXTS = [
    "Hi 👩‍💻 and 👨‍👩‍👧‍👦, flags 🇯🇵 🇫🇷 🏳️‍🌈!",
    "東京タワーは高い。你好世界，한국어도 돼요.",
    "Café, niño, über, Ångström, naïve façade.",
    'def f(x):\n\tif x:\n        return {"a": [1, 2]}\n\t}\n',
]


@pytest.fixture(scope="module")
def tok(smollm2) -> Tokenizer:
    return Tokenizer.from_dir(smollm2)


@pytest.fixture(scope="module")
def byte_fallback_tok() -> Tokenizer:
    """A SentencePiece/Llama-style tokenizer: letters, '▁', and <0xNN> byte-fallback tokens for everything else."""
    vocab = {"<unk>": 0, "</s>": 1, "▁": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({ch: len(vocab) + i for i, ch in enumerate("abcdefghijklmnopqrstuvwxyzH")})
    raw = RawTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.add_special_tokens(["</s>"])
    return Tokenizer(raw.to_str(), {"eos_token": "</s>"}, None)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


def run(text_stream: TextStream, ids: list[int]) -> list[StreamDelta]:
    """Feed ids until the stream finishes; check the invariant that the deltas add up to the stream's text."""
    deltas = []
    for i in ids:
        deltas.append(text_stream.add(i))
        if deltas[-1].finished:
            break
    assert "".join(d.text for d in deltas) == text_stream.text
    return deltas


def test_some_token_ends_mid_character(tok):
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_breaks_a_character_and_adds_up(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    if any(ord(ch) > 127 for ch in text):
        assert "" in deltas[:-1]  # some token was held until its character completed


def test_byte_fallback_tokens_are_held_until_the_character_completes(byte_fallback_tok):
    text = "Ha é 東京 a"
    ids = byte_fallback_tok.encode(text, add_special_tokens=False)
    assert any(byte_fallback_tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    deltas = stream(IncrementalDetokenizer(byte_fallback_tok), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text
    assert {"é", "東", "京"} <= set(deltas)  # each multi-byte character arrives whole, as one delta


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tok, skip):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Ça va? 🙂"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in "".join(deltas)) is not skip


def test_cost_per_token_is_a_short_window(tok):
    ids = tok.encode(" ".join(TEXTS) * 10, add_special_tokens=False)
    lengths = []
    decode = tok.decode
    tok.decode = lambda window, **kw: lengths.append(len(window)) or decode(window, **kw)
    try:
        deltas = stream(IncrementalDetokenizer(tok), ids)
    finally:
        del tok.decode
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 500 and max(lengths) <= 8


def test_flush_releases_an_incomplete_character(tok):
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    text_stream = TextStream(tok)
    deltas = run(text_stream, ids[:cut])
    assert not any("\ufffd" in d.text for d in deltas)
    last = text_stream.finish("length")
    assert last.finished and last.finish_reason == "length" and last.text.endswith("\ufffd")
    assert text_stream.text == tok.decode(ids[:cut])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_a_token_boundary(tok, include):
    text, stop = "Hello.\n\nNext paragraph", "\n\n"
    ids = tok.encode(text, add_special_tokens=False)
    prefixes = [tok.decode(ids[:k]) for k in range(1, len(ids))]
    assert any(p.endswith(stop[:1]) and not p.endswith(stop) for p in prefixes)  # a token split falls inside it
    text_stream = TextStream(tok, stop=[stop], include_stop_str_in_output=include)
    deltas = run(text_stream, ids)
    assert not any("\n" in d.text for d in deltas[:-1])  # the first "\n" was held back, not emitted
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop" and deltas[-1].stop == stop
    assert text_stream.text == ("Hello.\n\n" if include else "Hello.")
    with pytest.raises(GenerationError):
        text_stream.add(ids[-1])


def test_stop_string_inside_one_token(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    text_stream = TextStream(tok, stop=["ll"])
    deltas = run(text_stream, ids)
    assert len(deltas) == 1 and deltas[0].finished and text_stream.text == "He"


def test_held_text_that_does_not_match_is_released(tok):
    text = "xyz abcX abc done"
    ids = tok.encode(text, add_special_tokens=False)
    text_stream = TextStream(tok, stop=["abcd"], max_tokens=len(ids))
    deltas = run(text_stream, ids)
    assert [tok.decode([i]) for i in ids] == ["xyz", " abc", "X", " abc", " done"]
    assert [d.text for d in deltas] == ["xyz", " ", "abcX", " ", "abc done"]  # "abc" held, then released
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop is None
    assert text_stream.text == text


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("Hello world, again", add_special_tokens=False)
    text_stream = TextStream(tok, stop=["world", "o w", "again"])
    deltas = run(text_stream, ids)
    assert deltas[-1].stop == "o w" and text_stream.text == "Hell"


def test_eos_stops_without_text(tok):
    eos = eos_token_ids({"eos_token_id": 2}, tok)
    ids = tok.encode("Done 🙂", add_special_tokens=False)
    text_stream = TextStream(tok, stop_token_ids=eos, max_tokens=100)
    deltas = run(text_stream, [*ids, 2, *ids])
    assert len(deltas) == len(ids) + 1
    assert deltas[-1] == StreamDelta("", True, "stop", 2)
    assert text_stream.text == "Done 🙂" and text_stream.finish_reason == "stop"


def test_eos_releases_text_held_for_a_stop_string(tok):
    ids = tok.encode("one abc", add_special_tokens=False)
    text_stream = TextStream(tok, stop=["abcd"], stop_token_ids={2})
    deltas = run(text_stream, [*ids, 2])
    assert [d.text for d in deltas] == ["one", " ", "abc"]  # "abc" was held until EOS ruled out "abcd"
    assert deltas[-1] == StreamDelta("abc", True, "stop", 2)
    assert text_stream.text == "one abc"


def test_max_tokens_finishes_with_length(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    text_stream = TextStream(tok, max_tokens=2)
    deltas = run(text_stream, ids)
    assert len(deltas) == 2 and deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert text_stream.text == tok.decode(ids[:2])


def test_eos_token_ids(tok, byte_fallback_tok):
    assert tok.special_tokens()["eos_token"] == "<|im_end|>"
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    assert eos_token_ids({"eos_token_id": [0, 7]}, tok) == {0, 7, im_end}
    assert eos_token_ids({"eos_token_id": 0}, tok) == {0, im_end}
    assert eos_token_ids(None, tok) == {im_end} == {2}
    assert eos_token_ids({"eos_token_id": [5]}, byte_fallback_tok) == {1, 5}


def test_matches_transformers_decode(tok, smollm2):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        assert "".join(stream(IncrementalDetokenizer(tok), ids)) == reference.decode(ids, skip_special_tokens=True)


def test_imports_without_torch(without_torch):
    done = without_torch("import llmlower.runtime.detokenizer; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
