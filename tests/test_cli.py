"""The `llmlower` command: generate --json fields and structured output, inspect's KV-cache figures, passes
listing."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from llmlower.cli import main
from llmlower.passes import PASSES

REFERENCE = ["--backend", "torch"]  # the torch reference: generate's fields without compiling (test_compile_cache)


def test_generate_json(tiny_llama, capsys):
    code = main(["generate", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "5", "--json", *REFERENCE])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "timing"}
    assert set(out["timing"]) >= {"ttft_s", "decode_tokens_per_s"}
    assert 1 <= len(out["token_ids"]) <= 5
    assert out["prompt_token_ids"][0] == 3  # <|im_start|>: the chat template was applied
    assert out["finish_reason"] in ("stop", "length")


def test_generate_raw_skips_the_template(tiny_llama, capsys):
    main(["generate", str(tiny_llama), "--prompt", "Hello", "--max-tokens", "2", "--json", "--raw", *REFERENCE])
    out = json.loads(capsys.readouterr().out)
    assert 3 not in out["prompt_token_ids"]


def test_generate_with_a_json_schema_or_a_regex(tiny_llama, tmp_path, capsys):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    args = ["generate", str(tiny_llama), "--prompt", "Hi", "--raw", "--json", *REFERENCE]
    assert main([*args, "--json-schema", str(tmp_path / "schema.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 <= json.loads(out["text"])["n"] <= 9 and out["finish_reason"] == "stop"
    assert main([*args, "--regex", "[0-9]{3}"]) == 0
    assert re.fullmatch("[0-9]{3}", json.loads(capsys.readouterr().out)["text"])
    assert main([*args, "--regex", "(abc"]) == 1
    err = capsys.readouterr().err
    assert "structured_output.regex: not a valid regex" in err and "Traceback" not in err
    assert main([*args, "--grammar", str(tmp_path / "missing.lark")]) == 1
    assert "missing.lark: cannot be read" in capsys.readouterr().err


def test_inspect_reports_kv_bytes(tiny_llama, capsys):
    assert main(["inspect", str(tiny_llama), "--context", "100", "--batch", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spec"]["num_kv_heads"] == 2
    assert report["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert report["kv_cache"]["bytes"] == 2 * 2 * 2 * 16 * 4 * 100 * 3
    assert report["parameters"] > 0


def test_passes_lists_registered_passes():
    done = subprocess.run([sys.executable, "-m", "llmlower.cli", "passes"], capture_output=True, text=True)
    assert done.returncode == 0
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    assert {name for name in PASSES if not name.startswith("test_")} == set(names)  # tests register their own
    assert {"canonicalize", "kv_cache", "fuse_norms", "fuse_rope", "fuse_projections", "fuse_qkv_attention"} <= set(
        names
    )


def test_bad_flag_value_exits_nonzero_without_traceback(tiny_llama, capsys):
    code = main(["generate", str(tiny_llama), "--prompt", "x", "--max-tokens", "0"])
    err = capsys.readouterr().err
    assert code != 0 and "max_tokens" in err and "Traceback" not in err
