"""The `llmlower` command: generate --json fields, inspect's KV-cache figures, passes listing."""

from __future__ import annotations

import json
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
