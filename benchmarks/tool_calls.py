"""Function calling in the style of BFCL's single-turn cases, through an OpenAI-compatible server: `llmlower serve`
and, with --vllm, vLLM's CPU server (its hermes parser) on the same checkpoint, one after the other.

Each case (benchmarks/data/tool_calling_cases.jsonl, written for this project) is a question, one to three tools
and the call expected. Every case is asked greedily with tool_choice `required` and `auto`. A reply is *valid* when
it has calls and each names an offered function with arguments that parse as JSON and validate against its schema;
it *matches* when it is exactly the expected call (strings compared without case or surrounding blanks, numbers as
numbers; an argument the case leaves out may be absent). Both servers listen on 127.0.0.1 only.

    .venv/bin/python benchmarks/tool_calls.py [--model example] [--vllm] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
from http_vs_vllm import VLLM_PYTHON
from peers.runner import native_dtype
from serving import free_port, wait_healthy

from llmlower.frontend import resolve_model

CASES = Path(__file__).parent / "data" / "tool_calling_cases.jsonl"
CHOICES = ("required", "auto")
SERVED_NAME = "model"


def same(answer: object, expected: object) -> bool:
    """Values equal as a case wants them: strings without case or blanks around, numbers as numbers."""
    if isinstance(expected, str) and isinstance(answer, str):
        return answer.strip().lower() == expected.strip().lower()
    if isinstance(expected, bool) or isinstance(answer, bool):
        return answer is expected
    if isinstance(expected, int | float) and isinstance(answer, int | float):
        return float(answer) == float(expected)
    return answer == expected


def score(message: object, case: dict) -> tuple[bool, bool]:
    """(valid, matches) of a reply's message for a case."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in case["tools"]}
    calls = message.tool_calls or []
    try:
        parsed = [(call.function.name, json.loads(call.function.arguments)) for call in calls]
        for name, arguments in parsed:
            jsonschema.validate(arguments, schemas[name])
    except (json.JSONDecodeError, jsonschema.ValidationError, KeyError):
        return False, False
    if len(parsed) != 1:
        return bool(parsed), False
    (name, arguments), expected = parsed[0], case["expected"]
    wanted = expected["arguments"]
    matches = name == expected["name"] and set(wanted) <= set(arguments)
    matches = matches and set(arguments) <= set(schemas[name]["properties"])
    return True, matches and all(same(arguments[key], value) for key, value in wanted.items())


def run_cases(url: str, cases: list[dict]) -> dict[str, dict]:
    """Every case under every tool_choice: the rates, and each reply's verdict."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    results: dict[str, dict] = {}
    for choice in CHOICES:
        verdicts = []
        for index, case in enumerate(cases):
            reply = client.chat.completions.create(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": case["question"]}],
                tools=case["tools"],
                tool_choice=choice,
                temperature=0,
                max_tokens=256,
            )
            message = reply.choices[0].message
            valid, matches = score(message, case)
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            verdicts.append({"case": index, "valid": valid, "matches": matches, "calls": calls})
            print(f"[tools] {choice} {index + 1}/{len(cases)}: valid={valid} matches={matches}", file=sys.stderr)
        count = len(verdicts)
        valid_rate = sum(v["valid"] for v in verdicts) / count
        match_rate = sum(v["matches"] for v in verdicts) / count
        results[choice] = {"valid": valid_rate, "matches": match_rate, "replies": verdicts}
    return results


def serve(name: str, command: list[str], environment: dict[str, str], url: str, cases: list[dict]) -> dict:
    """Start a server, run the cases through it, stop it."""
    print(f"[tools] {name}: starting the server", file=sys.stderr)
    server = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(server, url, name, 900)
        return run_cases(url, cases)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="example", help="a checkpoint directory or `example` (SmolLM2)")
    parser.add_argument("--recipe", default="auto")
    parser.add_argument("--vllm", action="store_true", help="also vLLM's CPU server with its hermes parser")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every reply's verdict here")
    args = parser.parse_args()
    cases = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    checkpoint = resolve_model(args.model)
    rows = {}
    port = free_port()
    ours = [sys.executable, "-m", "llmlower.cli", "serve", str(checkpoint), "--port", str(port)]
    ours += ["--served-model-name", SERVED_NAME, "--recipe", args.recipe, "--threads", str(args.threads)]
    rows[f"llmlower serve (recipe {args.recipe})"] = serve(
        "llmlower", ours, dict(os.environ), f"http://127.0.0.1:{port}", cases
    )
    if args.vllm:
        if not VLLM_PYTHON.exists():
            raise SystemExit(f"{VLLM_PYTHON} is missing: run `bash benchmarks/peers/setup.sh vllm` first")
        port = free_port()
        theirs = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
        theirs += ["--served-model-name", SERVED_NAME, "--dtype", native_dtype(), "--host", "127.0.0.1"]
        theirs += ["--port", str(port), "--max-model-len", "2048", "--seed", "0"]
        theirs += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        environment = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        }
        rows["vLLM server (hermes parser)"] = serve("vLLM", theirs, environment, f"http://127.0.0.1:{port}", cases)
    print(f"\n{len(cases)} cases, greedy, max_tokens 256\n")
    print("| server | tool_choice | valid calls | exact match |")
    print("|---|---|---:|---:|")
    for name, results in rows.items():
        for choice, result in results.items():
            print(f"| {name} | {choice} | {result['valid']:.0%} | {result['matches']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
