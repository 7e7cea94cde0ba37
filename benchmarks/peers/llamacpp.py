"""Decode speed, TTFT and offline throughput of llama.cpp (llama-cpp-python) on token prompts; prints one JSON line
(see docs/benchmarks.md). Offline: vLLM's offline workload (runner.offline_prompts, all at once, OFFLINE_NEW greedy
tokens each) on one context of OFFLINE_REQUESTS parallel sequences, each step one batch of every sequence's next
token, as llama.cpp's server decodes its parallel slots (-np).

.venv-llamacpp/bin/python llamacpp.py --model FILE.gguf --prompts P.json [--new-tokens N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import llama_cpp
import llama_cpp.llama_cpp as llama_c_api
import numpy as np
from llama_cpp import Llama
from runner import OFFLINE, OFFLINE_NEW, OFFLINE_REQUESTS, offline_prompts, parse, report

# a child loads the model with llama.cpp's defaults and evaluates four tokens: on a Sapphire Rapids VM its AMX path
# (one of its "extra buffer types", with the repacked weight layouts) dies with SIGSEGV there
PROBE = "import sys; from llama_cpp import Llama; Llama(sys.argv[1], n_ctx=64, verbose=False).eval([1, 2, 3, 4])"


def extra_buffers_run(model: str) -> bool:
    """Whether llama.cpp's extra buffer types (AMX, repacked weights) evaluate on this machine without crashing."""
    return subprocess.run([sys.executable, "-c", PROBE, model], capture_output=True).returncode == 0


def without_extra_buffers() -> None:
    """Load models from here on with use_extra_bufts off (llama-cpp-python does not expose it)."""
    defaults = llama_c_api.llama_model_default_params

    def params() -> llama_c_api.llama_model_params:
        chosen = defaults()
        chosen.use_extra_bufts = False
        return chosen

    llama_c_api.llama_model_default_params = params


def last_logits(llm: Llama) -> np.ndarray:
    """The logits of the last evaluated position, as a view on llama.cpp's buffer."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def prefill(llm: Llama, ids: list[int]) -> np.ndarray:
    """Evaluate ids on an empty KV cache (eval drops every cell past n_tokens, here 0) and return the last logits."""
    llm.reset()
    llm.eval(ids)
    return last_logits(llm)


def prefill_time(llm: Llama, ids: list[int]) -> float:
    """Seconds to prefill ids from an empty cache and get the logits of the last position."""
    started = time.perf_counter()
    prefill(llm, ids)
    return time.perf_counter() - started


def decode_speed(llm: Llama, ids: list[int], new_tokens: int) -> float:
    """Tokens/s of the new_tokens - 1 greedy steps (argmax, EOS ignored) that follow the prefill of ids."""
    token = int(prefill(llm, ids).argmax())
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(last_logits(llm).argmax())
    elapsed = time.perf_counter() - started
    assert llm.n_tokens == len(ids) + new_tokens - 1, llm.n_tokens
    return (new_tokens - 1) / elapsed


def offline_throughput(llm: Llama, prompts: list[list[int]], threads: int) -> float:
    """Output tokens/s of `prompts` decoded together, OFFLINE_NEW greedy tokens each (EOS ignored): every prompt in
    one batch (llama.cpp splits it in micro-batches), then one batch a step of each sequence's next token."""
    params = llama_c_api.llama_context_default_params()
    params.n_ctx = len(prompts) * (max(map(len, prompts)) + OFFLINE_NEW + 8)
    params.n_batch = max(2048, sum(map(len, prompts)))
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    ctx = llama_c_api.llama_init_from_model(llm._model.model, params)
    batch = llama_c_api.llama_batch_init(params.n_batch, 0, 1)
    vocab = llm.n_vocab()

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Evaluate (token, position, sequence, wants logits) entries; the greedy next token of each that wants."""
        batch.n_tokens = len(entries)
        for i, (token, position, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, wants
            batch.seq_id[i][0] = seq
        if llama_c_api.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        outputs = [i for i, entry in enumerate(entries) if entry[3]]
        rows = (llama_cpp.llama_get_logits_ith(ctx, i) for i in outputs)
        return [int(np.ctypeslib.as_array(row, shape=(vocab,)).argmax()) for row in rows]

    try:
        started = time.perf_counter()
        llama_c_api.llama_memory_clear(llama_c_api.llama_get_memory(ctx), True)
        entries = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        tokens = decode(entries)
        for step in range(OFFLINE_NEW - 1):
            tokens = decode(
                [(t, len(ids) + step, s, True) for s, (t, ids) in enumerate(zip(tokens, prompts, strict=True))]
            )
        return len(prompts) * OFFLINE_NEW / (time.perf_counter() - started)
    finally:
        llama_c_api.llama_batch_free(batch)
        llama_c_api.llama_free(ctx)


def main() -> None:
    """Parse the arguments, measure, print the JSON line."""
    args, prompts = parse(__doc__.splitlines()[0], "GGUF file")
    longest = max(len(ids) for ids in prompts.values())
    batch = max(512, longest)  # the longest prompt goes through in one batch
    extra_buffers = extra_buffers_run(args.model)
    if not extra_buffers:
        without_extra_buffers()
    llm = Llama(
        args.model,
        n_ctx=longest + args.new_tokens,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )  # flash_attn off, f16 KV cache: llama-cpp-python's defaults
    print(f"[llamacpp] {llama_cpp.llama_print_system_info().decode().strip()}", file=sys.stderr)
    offline = offline_prompts(prompts)
    speeds = [offline_throughput(llm, offline, args.threads) for _ in range(args.repeats)]
    print(f"[llamacpp] {OFFLINE_REQUESTS} requests: {statistics.median(speeds):.1f} tok/s", file=sys.stderr)
    report(
        "llamacpp",
        "llama.cpp (llama-cpp-python)" + ("" if extra_buffers else ", extra buffer types off: they crash here"),
        llama_cpp.__version__,
        prompts,
        args,
        lambda ids: prefill_time(llm, ids),
        lambda ids, new_tokens: decode_speed(llm, ids, new_tokens),
        {OFFLINE: statistics.median(speeds)},
    )


if __name__ == "__main__":
    main()
