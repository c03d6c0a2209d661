"""BENCHMARKS.md from the results in bench/results/ (or the quick ones): every figure beside its
anchor — what it is compared with, measured in the same run — and their ratio, the machine and
date of each measurement, and plots where a picture reads better.

    python bench/report.py [--quick] [--out BENCHMARKS.md]

Each section reads one script's JSON; a missing file or figure is said, never invented."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, machine, results_dir  # noqa: E402

# (figure, value, anchor name, anchor value, higher is better?[, target]): a target reads
# "≥ 0.95x" / "≤ 3x" (on the ratio) or "≤ 1 s" / "≥ 60 %" (on the value)
Row = tuple[Any, ...]


def g(d: Any, path: str, default: Any = None) -> Any:
    """d["a"]["b"][0]... for "a/b/0" (keys hold dots: "llama.cpp"), or `default` where any step
    is missing."""
    for part in path.split("/"):
        if isinstance(d, dict) and part in d:
            d = d[part]
        elif isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        else:
            return default
    return d


def fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        a = abs(v)
        return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    return str(v)


def passes(target: str | None, value: Any, anchor: Any) -> bool | None:
    """Whether `value` (or its ratio to `anchor`, for an "x" target) meets `target`."""
    if not target:
        return None
    op, _, rest = target.partition(" ")
    number, _, unit = rest.partition(" ")
    if unit.startswith("x") or number.endswith("x"):
        if not (isinstance(value, (int, float)) and isinstance(anchor, (int, float)) and anchor):
            return None
        v, limit = value / anchor, float(number.rstrip("x"))
    else:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        v, limit = float(value), float(number)
    return v >= limit if op == "≥" else v <= limit


def ratio(value: Any, anchor: Any) -> str:
    if isinstance(value, (int, float)) and isinstance(anchor, (int, float)) and anchor and not isinstance(value, bool):
        return f"{value / anchor:.2f}x"
    return "—"


# -- sections: (file name, title, what is claimed, rows, plot) ----------------------------------


def rows_llamacpp_overhead(d: dict) -> list[Row]:
    m = d.get("median", {})
    return [("decode tokens/s through localllm", m.get("our_decode"), "raw llama-cpp-python", m.get("raw_decode"), True,
             "≥ 0.95x"),
            (f"TTFT s, {fmt(d.get('ttft_prompt_tokens'))}-token prompt", m.get("our_ttft"), "raw llama-cpp-python",
             m.get("raw_ttft"), False, "≤ 1.05x")]  # fmt: skip


def rows_engine_batching(d: dict) -> list[Row]:
    m = d.get("median", {})
    # issue 10's goals: one stream at most 5% below raw; 4 and 8 streams at least 80% of raw
    out: list[Row] = [(f"{n} streams: tokens/s through the engine", m.get(f"engine_{n}"),
                       f"llama.cpp's own batch of {n}", m.get(f"raw_{n}"), True, "≥ 0.95x" if n == 1 else "≥ 0.8x")
                      for n in (1, 4, 8)]  # fmt: skip
    lp = g(d, "long_prompt/median", {})
    out.append((f"p95 TPOT beside a {fmt(lp.get('long_prompt_tokens'))}-token prompt (s)", lp.get("p95_tpot_with_s"),
                "p95 TPOT alone", lp.get("p95_tpot_without_s"), False, "≤ 3x"))  # fmt: skip
    return out


def plot_engine_batching(d: dict, ax: Any) -> None:
    m = d.get("median", {})
    ns = [n for n in (1, 4, 8) if f"engine_{n}" in m]
    ax.plot(ns, [m[f"raw_{n}"] for n in ns], "o--", label="llama.cpp batch (raw)")
    ax.plot(ns, [m[f"engine_{n}"] for n in ns], "o-", label="localllm engine")
    ax.set(xlabel="concurrent streams", ylabel="tokens/s (aggregate)", title="Continuous batching")


def rows_torch_engine(d: dict) -> list[Row]:
    m = g(d, "models/smollm2", {})
    dec, pre = m.get("decode_tokens_per_s", {}), m.get("prefill_tokens_per_s", {})
    out: list[Row] = []
    for k, name in (("ours_auto", "default (int4 FFN on CPU)"), ("ours_f16", "f16"), ("ours_f32", "f32")):
        out.append((f"decode tokens/s, torch engine {name}", dec.get(k), "transformers", dec.get("transformers_dynamic"), True))
        out.append((f"decode tokens/s, torch engine {name}", dec.get(k), "llama.cpp", dec.get("llama.cpp"), True))
    out[0] = (*out[0], "≥ 2.5x")
    out[1] = (*out[1], "≥ 0.5x")
    out.append(("prefill tokens/s, torch engine default", pre.get("ours_auto"), "llama.cpp", pre.get("llama.cpp"), True))
    out.append(("prefill tokens/s, torch engine default", pre.get("ours_auto"), "transformers", pre.get("transformers"), True))
    out.append(("fp32 decode tokens/s", dec.get("ours_f32"), "the weight-streaming floor (fused matrices)",
                g(m, "floor/fused/tokens_per_s"), True, "≥ 0.85x"))
    rss = m.get("load_and_rss", {})
    for k, name in (("ours:auto", "default"), ("ours:f32", "f32")):
        out.append((f"load seconds, torch engine {name}", g(rss, f"{k}/load_s"), "transformers",
                    g(rss, "transformers/load_s"), False))
        out.append((f"peak RSS MB, torch engine {name}", g(rss, f"{k}/peak_rss_mb"), "transformers",
                    g(rss, "transformers/peak_rss_mb"), False))
    c = m.get("concurrent", {})
    out.append(("8 streams in the engine: tokens/s", c.get("tokens_per_s_8"), "one stream", c.get("tokens_per_s_1"),
                True, "≥ 3x"))
    return out  # fmt: skip


def plot_torch_engine(d: dict, ax: Any) -> None:
    dec = g(d, "models/smollm2/decode_tokens_per_s", {})
    names = [("transformers_dynamic", "transformers"), ("ours_f32", "ours f32"), ("ours_f16", "ours f16"),
             ("ours_auto", "ours default"), ("llama.cpp", "llama.cpp")]  # fmt: skip
    names = [(k, n) for k, n in names if k in dec]
    ax.bar([n for _, n in names], [dec[k] for k, _ in names], color=["#999", "#48c", "#48c", "#26a", "#c84"][: len(names)])
    ax.set(ylabel="decode tokens/s", title="Torch engine vs transformers and llama.cpp (SmolLM2)")


def rows_kv_types(d: dict) -> list[Row]:
    out: list[Row] = []
    for backend in ("llama.cpp", "torch"):
        types = g(d, f"types/{backend}", {})
        f16 = g(types, "f16/perplexity")
        for name, r in types.items():
            if name == "f16" or not isinstance(r, dict):
                continue
            target = {"int8": "≤ 0.527x", "int4": "≤ 0.286x", "int2": "≤ 0.167x"}.get(name) if backend == "torch" else None
            out.append((f"{backend} KV {name}: bytes/token", r.get("kv_bytes_per_token"), "f16",
                        g(types, "f16/kv_bytes_per_token"), False, target))  # fmt: skip
            target = {"int8": "≤ 1.005x", "int4": "≤ 1.03x"}.get(name) if backend == "torch" else None
            out.append((f"{backend} KV {name}: perplexity (KL mean {fmt(r.get('kl_mean'))}, p99 {fmt(r.get('kl_p99'))}, "
                        f"top-1 {fmt(r.get('top1_agreement'))})", r.get("perplexity"), "f16", f16, False, target))  # fmt: skip
    out.append(("torch int4 cache: perplexity cost", g(d, "types/torch/int4/ppl_cost"), "llama.cpp q4_0's",
                g(d, "types/llama.cpp/q4_0/ppl_cost"), False, "≤ 0.5x"))  # fmt: skip
    return out


def plot_kv_types(d: dict, ax: Any) -> None:
    for backend, marker in (("llama.cpp", "s"), ("torch", "o")):
        types = {k: v for k, v in g(d, f"types/{backend}", {}).items() if isinstance(v, dict) and k != "f16"}
        xs = [v.get("kv_bytes_per_token") for v in types.values()]
        ys = [v.get("kl_mean") for v in types.values()]
        ax.scatter(xs, ys, marker=marker, label=backend)
        for (name, _), x, y in zip(types.items(), xs, ys, strict=True):
            if x is not None and y is not None:
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="KV bytes per token", ylabel="KL vs f16 cache (nats)", yscale="log", title="KV-cache types")


def rows_streaming(d: dict) -> list[Row]:
    s = d.get("streaming", {})
    out: list[Row] = []
    for eng in ("llama.cpp", "torch"):
        out.append((f"{eng}: perplexity past the cache with 4 sinks", g(s, f"sinks_vs_none/{eng}/sinks_4"),
                    "without sinks (window only)", g(s, f"sinks_vs_none/{eng}/sinks_0"), False))  # fmt: skip
    for run in ("llamacpp_f16", "torch_f16", "torch_int4"):
        r = g(s, f"runs/{run}", {})
        out.append((f"{run}: ms/token, last 1,000 of {fmt(s.get('tokens'))}", r.get("ms_per_token_last_1000"),
                    "first 1,000 after the cache filled", r.get("ms_per_token_first_1000_after_full"), False,
                    "≤ 1.1x" if run.startswith("torch") else None))  # fmt: skip (the torch engine's claim)
        out.append((f"{run}: perplexity at the oracle's positions", r.get("ppl_at_oracle_positions"),
                    "full-context oracle", g(s, "oracle/ppl"), False, "≤ 1.1x"))  # fmt: skip
    out.append(("torch StreamingLLM perplexity", g(s, "runs/torch_f16/ppl"), "llama.cpp's context shift",
                g(s, "runs/llamacpp_f16/ppl"), False, "≤ 1.05x"))  # fmt: skip
    h = d.get("h2o", {})
    out.append((f"H2O (budget {fmt(h.get('budget'))}) perplexity", g(h, "h2o/perplexity"), "full cache",
                g(h, "full/perplexity"), False))  # fmt: skip
    out.append(("recent-window-only perplexity at the same budget", g(h, "recent_only/perplexity"), "full cache",
                g(h, "full/perplexity"), False))
    out.append(("H2O perplexity", g(h, "h2o/perplexity"), "recent window only, same budget",
                g(h, "recent_only/perplexity"), False, "≤ 1x"))  # fmt: skip
    return out


def rows_speculative(d: dict) -> list[Row]:
    out: list[Row] = []
    for eng in ("torch", "llama.cpp", "torch_f32"):
        for mode in ("lookup", "self", "head"):
            r = g(d, f"grounded/{eng}/{mode}")
            if isinstance(r, dict):
                same = r.get("same_greedy_text")
                out.append((f"{eng} {mode} on an input-grounded answer: tokens/s (α {fmt(r.get('acceptance'))}, "
                            f"{fmt(r.get('tokens_per_pass'))} tokens a pass, same greedy text: {fmt(same)}"
                            + ("" if same is not False else f" to token {fmt(r.get('first_difference_at'))}") + ")",
                            r.get("tokens_per_s"), "plain decoding", g(d, f"grounded/{eng}/off/tokens_per_s"), True,
                            {("torch", "lookup"): "≥ 1.8x", ("torch", "head"): "≥ 2.5x"}.get((eng, mode))))  # fmt: skip
    for eng in ("torch", "llama.cpp"):
        for mode in ("lookup", "self", "head"):
            m = g(d, f"chat/{eng}/{mode}")
            if isinstance(m, dict) and "speedup_min" in m:
                out.append((f"{eng} {mode} on chat prompts: slowest prompt's speedup (mean {fmt(m.get('speedup_mean'))})",
                            m.get("speedup_min"), "plain decoding", 1.0, True, "≥ 1.1x" if mode == "head" else "≥ 0.95x"))  # fmt: skip
                if mode == "head":
                    out.append((f"{eng} head on chat prompts: mean speedup", m.get("speedup_mean"), "plain decoding",
                                1.0, True, "≥ 1.5x"))  # fmt: skip
    t = g(d, "head/training") or g(d, "head/stored")
    if isinstance(t, dict):
        out.append((f"draft head: held-out agreement with the model's next token ({fmt(t.get('tokens'))} training "
                    f"tokens, {fmt(t.get('seconds'))} s in all)", t.get("agreement", t.get("agree")), None, None, True))  # fmt: skip
    for mode in ("head:chain", "head:tree"):
        r, m = g(d, f"tree/grounded/{mode}"), g(d, f"tree/chat/{mode}")
        if isinstance(r, dict):
            out.append((f"torch {mode} (EAGLE-2 trees against a chain) on an input-grounded answer: tokens/s "
                        f"({fmt(r.get('tokens_per_pass'))} tokens a pass, same greedy text: {fmt(r.get('same_greedy_text'))})",
                        r.get("tokens_per_s"), "plain decoding", g(d, "tree/grounded/off/tokens_per_s"), True))  # fmt: skip
        if isinstance(m, dict):
            out.append((f"torch {mode} on chat prompts: mean speedup (slowest {fmt(m.get('speedup_min'))})",
                        m.get("speedup_mean"), "plain decoding", 1.0, True))  # fmt: skip
    for mode in ("lookup", "head"):
        r, m = g(d, f"gemma_head/grounded/{mode}"), g(d, f"gemma_head/chat/{mode}")
        if isinstance(r, dict):
            out.append((f"Gemma 3 {mode} on an input-grounded answer: tokens/s (same greedy text: "
                        f"{fmt(r.get('same_greedy_text'))})", r.get("tokens_per_s"), "plain decoding",
                        g(d, "gemma_head/grounded/off/tokens_per_s"), True))  # fmt: skip
        if isinstance(m, dict):
            out.append((f"Gemma 3 {mode} on chat prompts: mean speedup (slowest {fmt(m.get('speedup_min'))})",
                        m.get("speedup_mean"), "plain decoding", 1.0, True))  # fmt: skip
    t = g(d, "head_gemma/training") or g(d, "head_gemma/stored")
    if isinstance(t, dict):
        out.append((f"Gemma 3 draft head: held-out agreement ({fmt(t.get('tokens'))} training tokens, "
                    f"{fmt(t.get('seconds'))} s in all)", t.get("agreement", t.get("agree")), None, None, True))  # fmt: skip
    for key, model in (("self", "SmolLM2"), ("self_gemma", "Gemma 3")):
        t = g(d, f"{key}/tuned")
        if isinstance(t, dict):
            out.append((f"{model} self: tuned skip set {t.get('skip')} (k {t.get('k')}, pays: {fmt(t.get('pays'))}) speedup",
                        t.get("speedup"), "plain decoding", 1.0, True, "≥ 1.2x"))  # fmt: skip
    lk = g(d, "self_gemma/grounded/lookup")
    if isinstance(lk, dict):
        out.append(("Gemma 3 lookup, grounded: tokens/s", lk.get("tokens_per_s"), "plain decoding",
                    g(d, "self_gemma/grounded/off/tokens_per_s"), True))  # fmt: skip
    return out


def plot_speculative(d: dict, ax: Any) -> None:
    labels, vals = [], []
    for eng in ("torch", "llama.cpp"):
        for mode in ("lookup", "self", "head"):
            v = g(d, f"grounded/{eng}/{mode}/speedup")
            if v is not None:
                labels.append(f"{eng}\n{mode}")
                vals.append(v)
    ax.bar(labels, vals, color="#48c")
    ax.axhline(1.0, color="#c44", lw=1)
    ax.set(ylabel="speedup over plain decoding", title="Speculative decoding (input-grounded answer)")


def rows_server(d: dict) -> list[Row]:
    ll = d.get("llamacpp_8_streams", {})
    out: list[Row] = [
        (f"8 streams through our server (llama.cpp), while all decode: tokens/s ({fmt(g(ll, 'ours_8/complete'))} of "
         f"{fmt(g(ll, 'ours_8/of'))} complete)", g(ll, "ours_8/all_decoding_tps"),
         "llama.cpp's own batch of 8", g(ll, "direct_8/tokens_per_s"), True, "≥ 0.8x"),
        ("8 streams through our server (llama.cpp): tokens/s, first send to last token", g(ll, "ours_8/aggregate_tps"),
         "llama-cpp-python's server", g(ll, "llama_cpp_python_8/aggregate_tps"), True, "≥ 1.8x"),
        ("8 streams: p95 TTFT (s)", g(ll, "ours_8/ttft_p95_s"), "llama-cpp-python's server",
         g(ll, "llama_cpp_python_8/ttft_p95_s"), False, "≤ 1x"),
    ]  # fmt: skip
    for key, name in (("torch_8_streams", "default"), ("torch_8_streams_f16", "f16")):
        rounds = g(d, f"{key}/rounds", [])
        if rounds:
            eight, one = (sorted(r[k]["aggregate_tps"] for r in rounds)[len(rounds) // 2] for k in ("eight", "single"))
            out.append((f"torch ({name}) 8 streams: tokens/s (medians of rounds)", eight, "one stream", one, True,
                        "≥ 3x"))
    for eng in ("llama.cpp", "torch"):
        out.append((f"{eng}: p95 TPOT during a long prompt's prefill (s)", g(d, f"chunked_prefill/{eng}/during_prefill/tpot_p95_s"),
                    "before it", g(d, f"chunked_prefill/{eng}/before/tpot_p95_s"), False, "≤ 3x"))
        pc = g(d, f"prefix_cache/{eng}", {})
        out.append((f"{eng}: warm TTFT, shared {fmt(pc.get('prompt_tokens'))}-token system prompt (s; identical answer: "
                    f"{fmt(pc.get('identical'))})", pc.get("ttft_warm_s"), "cold", pc.get("ttft_cold_s"), False, "≤ 0.15x"))
        out.append((f"{eng}: json_schema tokens/s (valid: {fmt(g(d, f'structured/{eng}/valid_json'))})",
                    g(d, f"structured/{eng}/json_schema"), "unconstrained", g(d, f"structured/{eng}/plain"), True, "≥ 0.8x"))
    return out  # fmt: skip


def plot_server(d: dict, ax: Any) -> None:
    ll = d.get("llamacpp_8_streams", {})
    bars = [("llama.cpp batch\n(no server)", g(ll, "direct_8/tokens_per_s")), ("ours", g(ll, "ours_8/aggregate_tps")),
            ("llama-cpp-python\nserver", g(ll, "llama_cpp_python_8/aggregate_tps"))]  # fmt: skip
    bars = [(n, v) for n, v in bars if v is not None]
    ax.bar([n for n, _ in bars], [v for _, v in bars], color=["#999", "#26a", "#c84"][: len(bars)])
    ax.set(ylabel="tokens/s, 8 concurrent streams", title="Server throughput (SmolLM2, llama.cpp)")


def rows_quantize(d: dict) -> list[Row]:
    out: list[Row] = []
    for t, r in d.get("types", {}).items():
        im = ", both given one importance matrix" if r.get("importance_matrix") else ""
        out.append((f"{t}: seconds, ours (identical bytes: {fmt(r.get('identical'))}{im})", r.get("median_localllm_s"),
                    "llama.cpp's quantize", r.get("median_llamacpp_s"), False, "≤ 1.5x" if t == "Q4_K_M" else None))  # fmt: skip
    for t, r in (d.get("calibration") or {}).items():
        if isinstance(r, dict) and "calibrated" in r:
            cal = d.get("calibration") or {}
            out.append((f"{t} KL vs F32 with --calibrate (on {cal.get('calibration_text')}, measured on "
                        f"{cal.get('eval_text')})", g(r, "calibrated/kl_mean"), "without", g(r, "plain/kl_mean"), False,
                        "≤ 1x"))  # fmt: skip
    return out


QUALITY_METHODS = ("plain", "imatrix", "gptq", "awq", "awq+gptq")


def rows_quantize_quality(d: dict) -> list[Row]:
    q = d.get("quality") or {}
    out: list[Row] = []
    for model, m in sorted((q.get("models") or {}).items(), key=lambda kv: kv[0] != "smollm2"):
        types = m.get("types") or {}
        for method in ("gptq", "awq", "awq+gptq"):
            if g(types, f"Q4_K_M/{method}/kl_mean") is not None:
                out.append((f"{model} Q4_K_M `--method {method}`: KL mean", g(types, f"Q4_K_M/{method}/kl_mean"),
                            "llama.cpp, imatrix, Q4_K_M", g(types, "Q4_K_M/imatrix/kl_mean"), False,
                            "≤ 0.75x" if method == "gptq" else None))  # fmt: skip
        for method in ("gptq", "awq+gptq"):
            if g(types, f"Q3_K_M/{method}/kl_mean") is not None:
                out.append((f"{model} Q3_K_M `--method {method}` ({fmt(g(types, f'Q3_K_M/{method}/bits_per_weight'))} "
                            f"bpw): KL mean", g(types, f"Q3_K_M/{method}/kl_mean"),
                            f"llama.cpp, imatrix, Q4_K_S ({fmt(g(types, 'Q4_K_S/imatrix/bits_per_weight'))} bpw)",
                            g(types, "Q4_K_S/imatrix/kl_mean"), False, "≤ 1x" if method == "gptq" else None))  # fmt: skip
        for t, r in types.items():
            for method in QUALITY_METHODS[1:]:
                x = r.get(method)
                if x and "kl_mean" in x:
                    out.append((f"{model} {t} {method}: KL mean (p99 {fmt(x['kl_p99'])}, top-1 "
                                f"{fmt(x['top1_agreement'])}, ppl {fmt(x['perplexity'])}, {x['bits_per_weight']:.2f} bpw)",
                                x["kl_mean"], f"plain (p99 {fmt(g(r, 'plain/kl_p99'))}, top-1 "
                                f"{fmt(g(r, 'plain/top1_agreement'))}, ppl {fmt(g(r, 'plain/perplexity'))})",
                                g(r, "plain/kl_mean"), False))  # fmt: skip
    return out


def plot_quantize_quality(d: dict, ax: Any) -> None:
    models = d["quality"]["models"]
    markers = dict(zip(QUALITY_METHODS, "os^Dv", strict=True))
    colors = dict(zip(QUALITY_METHODS, ("#999", "#c84", "#26a", "#6a4", "#a2a"), strict=True))
    for k, (model, m) in enumerate(sorted(models.items(), key=lambda kv: kv[0] != "smollm2")):
        for method in QUALITY_METHODS:
            pts = sorted((r[method]["bits_per_weight"], r[method]["kl_mean"]) for r in m["types"].values() if method in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[method], color=colors[method],
                        linestyle="-" if k == 0 else "--", label=f"{model}: {method}")  # fmt: skip
    ax.set(xlabel="bits per weight (file)", ylabel="KL vs F32 (mean)", yscale="log",
           title="Size vs quality: plain, imatrix (llama.cpp), ours")  # fmt: skip
    ax.legend(fontsize=6, ncol=2)


def rows_pull(d: dict) -> list[Row]:
    return [("localllm pull MB/s (new process, sha256 checked)", d.get("pull_MBps"), "curl", d.get("curl_MBps"), True,
             "≥ 0.8x"),
            ("pull in process MB/s", d.get("pull_in_process_MBps"), "curl", d.get("curl_MBps"), True)]  # fmt: skip


def rows_app(d: dict) -> list[Row]:
    out: list[Row] = []
    for name, t in (d.get("targets") or {}).items():
        if isinstance(t, dict):
            op = "≥" if "tokens_per_s" in name else "≤"
            out.append((name.replace("_", " "), t.get("value"), "target", t.get("target"), None,
                        f"{op} 1x"))  # fmt: skip
    return out


def rows_startup(d: dict) -> list[Row]:
    res = d.get("results", {})
    bare = g(res, "python -c pass/median_s")
    return [(f"`{cmd}` seconds", r.get("median_s"), "`python -c pass`", bare, False)
            for cmd, r in res.items() if cmd != "python -c pass" and isinstance(r, dict)]  # fmt: skip


def rows_run_shared(d: dict) -> list[Row]:
    local, shared = d.get("local") or {}, d.get("shared") or {}
    return [("`run` seconds, start to exit, while `serve` holds the model", shared.get("wall_s"),
             "`run --local`", local.get("wall_s"), False),
            ("`run` TTFT seconds", shared.get("ttft_s"), "`run --local`", local.get("ttft_s"), False),
            ("`run` process peak RSS MB", shared.get("rss_mb"), "`run --local`", local.get("rss_mb"), False)]  # fmt: skip


def rows_streaming_eval(d: dict) -> list[Row]:
    out: list[Row] = []
    for eng, r in (d.get("engines") or {}).items():
        chunk = g(r, "chunked/chunk")
        out.append((f"{eng}: seconds, chunks of {chunk}", g(r, "chunked/seconds"), "one token at a time",
                    g(r, "token_by_token/seconds"), False, "≤ 0.2x" if eng == "torch" else None))  # fmt: skip
        out.append((f"{eng}: perplexity, chunks of {chunk}", g(r, "chunked/perplexity"), "one token at a time",
                    g(r, "token_by_token/perplexity"), False, "≤ 1.005x"))  # fmt: skip
    return out


def rows_kv_pool(d: dict) -> list[Row]:
    p, w, c = d.get("prefix") or {}, d.get("window") or {}, d.get("codes") or {}
    st = d.get("streaming") or {}
    mib = lambda x: None if x is None else x / 2**20  # noqa: E731
    same = lambda r: "" if r.get("same_tokens") else " (tokens DIFFER)"  # noqa: E731
    return [(f"KV MiB in use, {p.get('slots')} slots on one {p.get('prefix_tokens')}-token prefix: blocks shared{same(p)}",
             mib(g(p, "shared/kv_bytes")), "copied into each slot", mib(g(p, "copied/kv_bytes")), False, None),
            ("ms to restore that prefix into a slot, shared", g(p, "shared/restore_ms"), "copied",
             g(p, "copied/restore_ms"), False, None),
            (f"Gemma 3: KV MiB in use at {w.get('context_tokens')} tokens, window layers keep their window{same(w)}",
             mib(g(w, "windowed/kv_bytes")), "every position kept", mib(g(w, "every position/kv_bytes")), False, None),
            ("Gemma 3: decode ms/token there, windowed", g(w, "windowed/decode_ms_per_token"), "every position kept",
             g(w, "every position/decode_ms_per_token"), False, None),
            (f"int8 KV: decode ms/token at {c.get('context_tokens')} tokens, codes in the pool{same(c)}",
             g(c, "pool/decode_ms_per_token"), "per-sequence stores", g(c, "stores/decode_ms_per_token"), False, None),
            ("int8 KV: KV MiB there, codes in the pool", mib(g(c, "pool/kv_bytes")), "per-sequence stores",
             mib(g(c, "stores/kv_bytes")), False, None),
            (f"StreamingLLM {st.get('sinks')}:{st.get('window')} after {st.get('context_tokens')} tokens: decode "
             f"ms/token, sinks and window in the pool{' (tokens part: rounding)' if not st.get('same_tokens') else ''}",
             g(st, "pool/decode_ms_per_token"), "stores of its own", g(st, "stores/decode_ms_per_token"), False, None),
            ("StreamingLLM: KV MiB there, in the pool", mib(g(st, "pool/kv_bytes")), "stores of its own",
             mib(g(st, "stores/kv_bytes")), False, None),
            ("StreamingLLM: decode ms/token there, in the pool, compiled", g(st, "pool, compiled/decode_ms_per_token"),
             "eager", g(st, "pool/decode_ms_per_token"), False, None)] + rows_kv_pool_more(d)  # fmt: skip


def rows_kv_pool_more(d: dict) -> list[Row]:
    """KIVI's int4 and H2O in the pool against their stores, at one slot and at several."""
    out: list[Row] = []
    mib = lambda x: None if x is None else x / 2**20  # noqa: E731
    for name, label in (("kivi", "int4 (KIVI) KV"), ("h2o", "H2O")):
        for slots, r in (d.get(name) or {}).items():
            n = slots.split()[0]  # "1 slots", "4 slots"
            what = f"{label}, {n} slot{'' if n == '1' else 's'} at {r.get('context_tokens')} tokens"
            if r.get("budget"):
                what += f", budget {r['budget']}"
            part = "" if r.get("same_tokens") else " (tokens part: rounding)"
            out += [(f"{what}: decode ms a step, in the pool{part}", g(r, "pool/decode_ms_per_token"),
                     "per-sequence stores", g(r, "stores/decode_ms_per_token"), False, None),
                    (f"{what}: KV MiB, in the pool", mib(g(r, "pool/kv_bytes")), "per-sequence stores",
                     mib(g(r, "stores/kv_bytes")), False, None)]  # fmt: skip
            if g(r, "pool, compiled/decode_ms_per_token") is not None:
                out.append((f"{what}: decode ms a step, in the pool, compiled",
                            g(r, "pool, compiled/decode_ms_per_token"), "eager",
                            g(r, "pool/decode_ms_per_token"), False, None))  # fmt: skip
    return out


def rows_torch_compile(d: dict) -> list[Row]:
    out: list[Row] = []
    for dtype in ("int4", "f32"):
        r = d.get(dtype)
        if not r:
            continue
        same = "" if r.get("same_tokens") else f" (tokens differ from token {r.get('first_difference')})"
        out += [(f"{dtype}: decode ms/token at 1 row, compiled{same}", g(r, "compiled, warm/ms_per_token"), "eager",
                 g(r, "eager/ms_per_token"), False, None),
                (f"{dtype}: decode ms/step at 8 rows, compiled", g(r, "compiled, warm/ms_per_step_8"), "eager",
                 g(r, "eager/ms_per_step_8"), False, None),
                (f"{dtype}: first step s, compiled, warm cache", g(r, "compiled, warm/first_step_s"),
                 "cold cache", g(r, "compiled, cold/first_step_s"), False, "≤ 3 s")]  # fmt: skip
    if d.get("llama.cpp") and d.get("int4"):
        out.append(("default (int4): decode ms/token at 1 row, compiled", g(d, "int4/compiled, warm/ms_per_token"),
                    "llama.cpp, same file (goal: ≥ 0.8x its speed)", g(d, "llama.cpp/ms_per_token"), False, "≤ 1.25x"))  # fmt: skip
    return out


def rows_gguf_parse(d: dict) -> list[Row]:
    return [(f"{name}: parse seconds, ours", r.get("localllm_s"), "gguf-py's reader", r.get("gguf_py_s"), False)
            for name, r in (d.get("results") or {}).items()]  # fmt: skip


def rows_agreement(d: dict) -> list[Row]:
    out: list[Row] = []
    for model, m in (d.get("models") or {}).items():
        for name, r in (g(m, "vs llama.cpp batch 512") or {}).items():
            out.append((f"{model}: {name} perplexity (top-1 {fmt(r.get('top1'))}, KL {fmt(r.get('kl'))})",
                        r.get("ppl"), "llama.cpp batch 512", r.get("ppl_ref"), False))  # fmt: skip
    return out


def rows_build(d: dict) -> list[Row]:
    m = d.get("median", {})
    return [("portable build decode tokens/s", g(m, "portable/decode_tps"), "native build", g(m, "native/decode_tps"), True),
            ("portable build prompt tokens/s", g(m, "portable/prompt_tps"), "native build", g(m, "native/prompt_tps"), True)]  # fmt: skip


def rows_gemv(d: dict) -> list[Row]:
    out: list[Row] = []
    for threads, t in (d.get("by_threads") or {}).items():
        dec = t.get("decode", {})
        out.append((f"{threads} threads: Fp16Linear decode tokens/s", g(dec, "Fp16Linear/tokens_per_s"), "fp32",
                    g(dec, "fp32/tokens_per_s"), True))  # fmt: skip
    return out


def rows_cuda(d: dict) -> list[Row]:
    out: list[Row] = []
    for model, m in (d.get("models") or {}).items():
        for mode, r in (m.get("modes") or {}).items():
            if isinstance(r, dict):
                out.append((f"{model} {mode}: decode tokens/s", r.get("tokens_per_s"), "", None, True))
                out.append((f"{model} {mode}: % of the HBM ceiling", r.get("pct_of_hbm_ceiling"), "", None, True))
    return out


def rows_llamacpp_gpu(d: dict) -> list[Row]:
    """Each model: the CUDA build at all layers and at half against the CPU build; the planner's
    expected decode rate against the measured one."""
    out: list[Row] = []
    rows = d.get("rows") or []
    for r in rows:
        cpu = next((c for c in rows if c["model"] == r["model"] and c["n_gpu_layers"] == 0), None)
        if "decode_tps" not in r:
            continue
        if r is not cpu:
            for what in ("decode", "prompt"):
                out.append((f"{r['model']}, {r['setting']}: {what} tokens/s", r.get(f"{what}_tps"), "cpu build",
                            (cpu or {}).get(f"{what}_tps"), True))  # fmt: skip
        if r.get("predicted_decode_tps"):
            out.append((f"{r['model']}, {r['setting']}: decode tokens/s measured against the planner's ({r['plan']})",
                        r.get("decode_tps"), "predicted", r["predicted_decode_tps"], True))  # fmt: skip
    return out


def rows_ceiling(d: dict) -> list[Row]:
    out: list[Row] = []
    pct = lambda x: f"{1000 * x['p50']:.0f} / {1000 * x['p95']:.0f} / {1000 * x['p99']:.0f}"  # noqa: E731
    for eng, r in (d.get("engines") or {}).items():
        for lv in r.get("levels", []):
            c = lv["concurrency"]
            who = f"{eng}, {c} client{'s' * (c > 1)}"
            out.append((f"{who}: decode tokens/s (TTFT ms p50/95/99 {pct(lv['ttft_s'])}; TPOT {pct(lv['tpot_s'])}; "
                        f"prompt {fmt(lv.get('prompt_tokens_per_s'))} tok/s a request, "
                        f"{fmt(lv.get('prefill_tokens_per_s'))} tok/s the machine's prefill)", lv.get("decode_tokens_per_s"),
                        "the bandwidth ceiling", lv.get("ceiling_tokens_per_s"), True))  # fmt: skip
            out.append((f"{who}: output tokens/s, first send to last token", lv.get("output_tokens_per_s"),
                        "one client" if c > 1 else "", r["levels"][0].get("output_tokens_per_s") if c > 1 else None, True))
            usd, usd_in = lv.get("usd_per_million_output"), lv.get("usd_per_million_input")
            if usd is not None:
                out.append((f"{who}: USD per million output tokens (input: {fmt(usd_in)}) at "
                            f"{fmt(g(r, 'price/usd_per_hour'))} USD/hour", usd, "", None, False))  # fmt: skip
    return out


def plot_ceiling(d: dict, ax: Any) -> None:
    for i, (eng, r) in enumerate((d.get("engines") or {}).items()):
        lv = r.get("levels", [])
        cs = [x["concurrency"] for x in lv]
        color = ["#26a", "#c84", "#4a4"][i % 3]
        ax.plot(cs, [x["decode_tokens_per_s"] for x in lv], "o-", color=color, label=f"{eng}: decode")
        ax.plot(cs, [x["output_tokens_per_s"] for x in lv], "x--", color=color, alpha=0.6,
                label=f"{eng}: with prefill (first send to last token)")  # fmt: skip
        ax.plot(cs, [x.get("ceiling_tokens_per_s") for x in lv], ":", color=color, label=f"{eng}: ceiling")
    ax.set(xlabel="concurrent clients", ylabel="tokens/s", yscale="log", ylim=(20, None),
           title="Decode against the memory-bandwidth ceiling")  # fmt: skip
    ax.legend(fontsize=6.5, loc="lower right", ncol=2)


SECTIONS: list[tuple[str, str, str, Callable[[dict], list[Row]], Callable[[dict, Any], None] | None]] = [
    ("llamacpp_overhead", "llama.cpp backend vs raw llama-cpp-python", "the engine adds no cost", rows_llamacpp_overhead, None),
    ("engine_batching", "Continuous batching", "many streams run at llama.cpp's own batch rate", rows_engine_batching,
     plot_engine_batching),
    ("torch_engine", "Torch engine", "faster than transformers on the same weights", rows_torch_engine, plot_torch_engine),
    ("kv_cache", "KV-cache types", "bytes per token down, perplexity held", rows_kv_types, plot_kv_types),
    ("kv_cache#streaming", "StreamingLLM and H2O", "flat latency and perplexity past the cache", rows_streaming, None),
    ("speculative", "Speculative decoding", "faster where drafts hit, never slower by much", rows_speculative,
     plot_speculative),
    ("server", "Server", "throughput and TTFT under concurrency; prefix cache; structured output", rows_server,
     plot_server),
    ("ceiling", "Decode ceiling and cost (`localllm bench`)", "how close to the hardware's limit, and what it costs",
     rows_ceiling, plot_ceiling),
    ("quantize", "Quantization", "every type byte-identical to llama.cpp; Q4_K_M within 1.5x its time; calibration helps "
     "(SmolLM2's 576-wide rows fit no 256-block: most of its matrices fall back to a 32-block type)",
     rows_quantize, None),
    ("quantize#quality", "Quantization quality: plain, imatrix, GPTQ, AWQ",
     "`--method gptq` Q4_K_M 25% below llama.cpp's imatrix Q4_K_M in KL; Q3_K_M-gptq at most llama.cpp's imatrix "
     "Q4_K_S (the sources: the packaged SmolLM2 Q4_1 and Gemma 3 Q4_K_M, dequantized to F32)", rows_quantize_quality,
     plot_quantize_quality),
    ("pull_throughput", "Pull", "as fast as curl, verified", rows_pull, None),
    ("app_latency", "Terminal app", "paints and answers keys fast", rows_app, None),
    ("startup", "Start-up", "`--help` and `list` start fast", rows_startup, None),
    ("run_shared", "One loaded model per machine", "`run` uses a running server's copy: no load, no second copy",
     rows_run_shared, None),
    ("streaming_eval", "`eval --streaming` by chunks", "5x faster than one token at a time, same perplexity",
     rows_streaming_eval, None),
    ("kv_pool", "Paged KV pool", "a shared prefix is held once; a window layer holds its window; codes, KIVI, StreamingLLM and H2O live in the pool", rows_kv_pool, None),
    ("torch_compile", "Compiled step", "the torch engine's compiled decode step against its eager path", rows_torch_compile, None),
    ("gguf_parse", "GGUF reading", "hardened and fast", rows_gguf_parse, None),
    ("llamacpp_agreement", "Agreement with llama.cpp", "the same perplexity", rows_agreement, None),
    ("llamacpp_build", "llama.cpp build", "the portable build costs little", rows_build, None),
    ("torch_gemv", "Matrix-vector kernels", "fp16 weights vs fp32", rows_gemv, None),
    ("torch_cuda", "CUDA", "the torch engine on a GPU", rows_cuda, None),
    ("llamacpp_gpu", "llama.cpp on a GPU", "a CUDA build for this GPU only; partial offload at the planner's rate",
     rows_llamacpp_gpu, None),
]  # fmt: skip


def machine_line(d: dict) -> str:
    m = d.get("machine") or d.get("machine_start")
    if m is None:  # results of several parts, each with its own machine (server.json)
        parts = {machine_line(v) for v in d.values() if isinstance(v, dict) and isinstance(v.get("machine"), dict)}
        if parts:
            return " / ".join(sorted(parts)) + " (per part)"
    if isinstance(m, dict):
        parts = [m.get("cpu"), f"{m['cores']} cores" if m.get("cores") else None, m.get("capability"), m.get("gpu")]
        return ", ".join(str(p) for p in parts if p)
    return str(m) if m else "a machine not recorded"


def render(results: Path, out: Path, quick: bool = False) -> Path:
    """Write `out` (Markdown) and its plots (beside it, in bench/results/plots or quick/plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = results / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    here = machine()
    lines = ["# localllm benchmarks", "",
             f"Generated by `bench/run_all.py{' --quick' if quick else ''}` on {time.strftime('%Y-%m-%d %H:%M')} "
             f"on {machine_line({'machine': here})}, {here.get('memory_bytes', 0) / 2**30:.0f} GiB memory"
             + (f", GPU {here['gpu']}" if here.get("gpu") else ", no GPU") + ".", "",
             "Each figure is compared with its anchor, measured side by side in the same run; the ratio is figure ÷ "
             "anchor (for times lower is better, for rates higher). Each section says which machine measured it: "
             "sections not rerun keep their last measurement." + (" **Quick mode: smoke-run sizes, not "
             "measurements to quote.**" if quick else ""), ""]  # fmt: skip
    for name, title, claim, rows_fn, plot_fn in SECTIONS:
        file = name.split("#")[0]
        path = results / f"{file}.json"
        lines += [f"## {title}", "", f"Claim: {claim}.", ""]
        if not path.is_file():
            why = (" (it needs a CUDA device; none was lent to the sessions that ran the suite)"
                   if file in ("torch_cuda", "llamacpp_gpu") else "")  # fmt: skip
            lines += [f"_No result yet: run `python bench/{file}.py`{why}._", ""]
            continue
        d = json.loads(path.read_text())
        if d.get("skipped"):
            lines += [f"_Not measured here: {d['skipped']}._", ""]
            continue
        when = d.get("when") or next((v["when"] for v in d.values() if isinstance(v, dict) and v.get("when")),
                                     "(time not recorded)")  # fmt: skip
        lines += [f"Measured {when} on {machine_line(d)} "
                  f"(`bench/{file}.py`, `{path.relative_to(results.parent) if results.parent in path.parents else path.name}`).", ""]  # fmt: skip
        try:
            rows = rows_fn(d)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # a shape this report does not know
            rows = []
            lines += [f"_The result's shape was not understood ({type(e).__name__}: {e})._", ""]
        if rows:
            lines += ["| figure | value | anchor | anchor value | ratio | target |", "|---|---:|---|---:|---:|---|"]
            for row in rows:
                fig, v, anchor, av = row[:4]
                target = row[5] if len(row) > 5 else None
                ok = passes(target, v, av)
                mark = "" if ok is None else (" ✓" if ok else " **✗ missed**")
                lines.append(f"| {fig} | {fmt(v)} | {anchor or '—'} | {fmt(av)} | {ratio(v, av)} | "
                             f"{target or ''}{mark} |")
            lines.append("")
        if plot_fn is not None:
            fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
            try:
                plot_fn(d, ax)
                if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:
                    ax.legend(fontsize=8)
                ax.grid(alpha=0.3)
                fig.tight_layout()
                png = plots / f"{name.replace('#', '_')}.png"
                fig.savefig(png)
                lines += [f"![{title}]({png.relative_to(out.parent) if out.parent in png.parents else png})", ""]
            except (KeyError, TypeError, ValueError, IndexError) as e:
                lines += [f"_No plot: the result lacks what it draws ({type(e).__name__})._", ""]
            finally:
                plt.close(fig)
    out.write_text("\n".join(lines))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="from the quick results (bench/results/quick)")
    ap.add_argument("--out", type=Path, default=None, help="default: BENCHMARKS.md at the top (quick: beside the results)")
    a = ap.parse_args()
    results = results_dir(a.quick)
    out = a.out or (results / "BENCHMARKS.md" if a.quick else BENCH.parent / "BENCHMARKS.md")
    print(render(results, out.resolve(), a.quick))


if __name__ == "__main__":
    main()
