"""Our overhead over raw llama-cpp-python on the default model, side by side in one run.

    .venv/bin/python bench/llamacpp_overhead.py [--rounds 3] [--gen 128] [--prompt-tokens 512]
        [--quick]

Decode: greedy generation of --gen tokens from the same raw prompt, (a) a raw llama-cpp-python
loop (`Llama.generate`, tokens only) and (b) localllm's engine (`Model.submit`, worker thread,
incremental detokenization, stop handling, Chunk stream) — tokens/s after the first token.
TTFT: a --prompt-tokens prompt (512), prompt cache cleared each time: (a) `Llama.generate` until the first
token, (b) localllm submit → first chunk. Same file, same n_ctx, threads and batch size.
Rounds alternate a/b to share machine noise. Writes bench/results/llamacpp_overhead.json.
`--quick`: one round, 16 tokens, a 64-token prompt (bench/results/quick/llamacpp_overhead.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import corpus_dir, save


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the TTFT prompt")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 16 + 64 tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.gen, args.prompt_tokens = 1, 16, 64
    os.environ.setdefault("LOCALLLM_HOME", tempfile.mkdtemp(prefix="localllm-bench-"))
    import llama_cpp

    from localllm.backends.llamacpp import default_threads
    from localllm.engine import load
    from localllm.types import Request, SamplingParams

    ours = load("smollm2", ctx=2048)
    path = ours.runner.model_path
    raw = llama_cpp.Llama(path, n_ctx=2048, n_batch=512, n_threads=default_threads(), verbose=False)
    text = (corpus_dir() / "moby_dick_part.txt").read_text()[50_000:]
    long_ids = raw.tokenize(text.encode())[: args.prompt_tokens]
    long_prompt = raw.detokenize(long_ids).decode()
    short = "Once upon a time"

    def raw_decode() -> float:
        raw.reset()
        ids = raw.tokenize(short.encode())
        t_first = None
        n = 0
        for _tok in raw.generate(ids, temp=0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0):
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n == args.gen:
                break
        return (n - 1) / (time.perf_counter() - t_first)

    def our_decode() -> float:
        ours.drop_caches()
        r = ours.submit(
            Request(prompt=short, sampling=SamplingParams(temperature=0, max_tokens=args.gen))
        ).wait()
        assert r.usage.completion_tokens == args.gen, r.finish_reason
        return r.timings.tokens_per_s(r.usage.completion_tokens)

    # each TTFT prompt starts with its own number: the engine's prefix cache must not answer
    # a round from the one before (it would, warm, in a few ms), nor llama.cpp's own KV reuse
    def raw_ttft(i: int) -> float:
        raw.reset()
        t0 = time.perf_counter()
        next(iter(raw.generate(raw.tokenize(f"{i}. {long_prompt}".encode()), temp=0)))
        return time.perf_counter() - t0

    def our_ttft(i: int) -> float:
        ours.drop_caches()
        s = ours.submit(
            Request(prompt=f"{i}. {long_prompt}", sampling=SamplingParams(temperature=0, max_tokens=1))
        )
        r = s.wait()
        assert r.usage.cached_tokens == 0, f"{r.usage.cached_tokens} prompt tokens came from a cache"
        return r.timings.ttft_s

    samples: dict[str, list[float]] = {
        k: [] for k in ("raw_decode", "our_decode", "raw_ttft", "our_ttft")
    }
    raw_decode(), our_decode()  # warm up
    for i in range(args.rounds):
        samples["raw_decode"].append(raw_decode())
        samples["our_decode"].append(our_decode())
        samples["raw_ttft"].append(raw_ttft(i))
        samples["our_ttft"].append(our_ttft(i))
    med = {k: statistics.median(v) for k, v in samples.items()}
    out = {
        "model": "smollm2:135m-instruct-q4_1", "threads": default_threads(), "gen_tokens": args.gen,
        "ttft_prompt_tokens": len(long_ids), "rounds": args.rounds, "samples": samples, "median": med,
        "decode_overhead": 1 - med["our_decode"] / med["raw_decode"],
        "ttft_overhead": med["our_ttft"] / med["raw_ttft"] - 1,
    }  # fmt: skip
    print(f"decode tokens/s  raw {med['raw_decode']:.1f}   localllm {med['our_decode']:.1f}   "
          f"overhead {out['decode_overhead'] * 100:+.1f}%")  # fmt: skip
    print(f"TTFT ({len(long_ids)} tokens)  raw {med['raw_ttft'] * 1000:.0f} ms   localllm "
          f"{med['our_ttft'] * 1000:.0f} ms   overhead {out['ttft_overhead'] * 100:+.1f}%")  # fmt: skip
    save("llamacpp_overhead", out, quick=args.quick)
    ours.close()
    raw.close()


if __name__ == "__main__":
    main()
