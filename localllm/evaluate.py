"""`localllm eval`: perplexity over a long text, evaluated the way generation runs, with what the KV
cache costs and, against a reference (another cache type, or another model), how far the
next-token distributions move.

The engine's scorer (`localllm.engine.scoring.Scorer`, through the runner's `forward`) returns
the logits after each token, evaluated through one slot's cache exactly as decoding would fill it
— one token at a time whenever a policy quantizes late (KIVI's residual) or forgets one by one
(H2O), whole chunks where that is the same computation, and under StreamingLLM chunks of the
window // 16 that slide the window as a prompt's chunks do in generation (`evaluated` says which).

    perplexity      exp(mean negative log-likelihood of tokens 2..N given what precedes them)
    kl_mean, kl_p99 KL(reference ‖ this) per position, in nats: mean and 99th percentile
    top1_agreement  share of positions where both put the same token first

With `--speculative MODE` it also says how well that drafter predicts this model on the text:
at every position, teacher-forced, whether the drafter's next token (lookup's proposal, the
layer-skipping model's or the draft model's argmax) is the model's own argmax — the greedy
acceptance α of a first draft — and the tokens per target pass (1 − α^(k+1)) / (1 − α) predicts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from localllm.engine.scoring import Scorer
from localllm.errors import LocalLLMError
from localllm.types import LoadOptions, speculative_mode

__all__ = ["evaluate", "read_text"]


def read_text(path: Path) -> str:
    """The text to evaluate, or one line saying why it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LocalLLMError(f"no such text file: {path}") from None
    except IsADirectoryError:
        raise LocalLLMError(f"{path} is a directory, not a text file") from None
    except UnicodeDecodeError as e:
        raise LocalLLMError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise LocalLLMError(f"cannot read {path}: {e.strerror or e}") from None
    if not text.strip():
        raise LocalLLMError(f"{path} is empty")
    return text


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32, copy=False)
    m = x.max(-1, keepdims=True)
    z = np.log(np.exp(x - m).sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return x - m - z


def _kv_stats(llm: Any, scorer: Any) -> dict[str, float]:
    """What the cache costs: measured by the torch engine's caches, computed from the model's
    shape for llama.cpp (which allocates every cell when the context is made)."""
    stats = scorer.kv_stats()
    if stats:
        return stats
    from localllm.memory import kv_bytes_per_token, parse_kv_cache
    from localllm.model_info import read_model_info

    info = read_model_info(llm.runner.model_path)
    per = kv_bytes_per_token(info, *parse_kv_cache(llm.options.kv_cache))
    return {"kv_bytes_per_token": per, "kv_residual_bytes": 0,
            "kv_peak_bytes": int(per * llm.runner.n_ctx), "kv_step_bytes": 0}  # fmt: skip


def evaluate(model: str, text: str, *, options: LoadOptions, limit: int | None = None,
             ref: str | None = None, ref_kv: str | None = None,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Perplexity of `model` (loaded with `options`) over the first `limit` tokens of `text`.

    With `ref` (a model) or `ref_kv` (a cache type), the same text also goes through the reference
    — that model, or this one with that cache type — with a full cache and no policy, and the
    result adds KL and top-1 agreement against it. `progress(done, total)` is called as it goes.
    """
    from localllm.engine import load
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    started = time.perf_counter()
    policy = options.context
    if limit is not None and limit < 2:
        raise LocalLLMError(f"--limit must be at least 2 tokens, got {limit}")
    # The context the run needs: the window under StreamingLLM, else the text — `limit` tokens,
    # or up to the model's own context when the text's length in tokens is not known yet.
    if policy.enabled:
        ctx = options.ctx or (policy.sinks or 0) + policy.window
    else:
        ctx = options.ctx or limit or ensure_local(model, Store()).info.context_length or 4096
    llm = load(model, options.replace(parallel=1, ctx=ctx))
    reference = None
    try:
        ids = llm.runner.tokenize(text, add_special=True)
        ids = ids[:limit] if limit else ids
        n = len(ids)
        if n < 2:
            raise LocalLLMError("the text has fewer than 2 tokens: nothing to predict")
        if not policy.enabled and n > llm.runner.n_ctx:
            raise LocalLLMError(f"the text has {n} tokens but the context holds "
                                f"{llm.runner.n_ctx}; use --limit or --streaming SINKS:WINDOW")  # fmt: skip
        ref_scorer = None
        if ref or ref_kv:
            ref_opts = options.replace(parallel=1, ctx=n, streaming=None, evict=None,
                                       kv_cache=ref_kv or options.kv_cache)  # fmt: skip
            reference = load(ref or model, ref_opts)
            if reference.runner.tokenize(text, add_special=True)[:n] != ids:
                raise LocalLLMError(f"{reference.name} tokenizes the text differently from "
                                    f"{llm.name}: no position-by-position comparison")  # fmt: skip
            ref_scorer = Scorer(reference.runner)
        scorers: list[Scorer] = []

        def score() -> dict[str, Any]:  # its slot cleared for the policy after run_here's drop
            scorers.append(Scorer(llm.runner, policy))
            return _score(ids, scorers[0], ref_scorer, progress)

        result = llm.run_here(score)
        scorer = scorers[0]
        spec = speculative_mode(options.speculative)
        if spec != "off":
            result["speculative"] = _acceptance(llm, spec, ids, result.pop("_argmax"))
        result.pop("_argmax", None)
        result.update(_kv_stats(llm, scorer))
        scorer.close()
        result.update({
            "model": llm.name, "backend": llm.runner.name, "kv_cache": llm.options.kv_cache,
            "streaming": options.streaming, "evict": options.evict,
            "evaluated": "token by token" if scorer.token_by_token else f"chunks of {scorer.chunk}",
            "reference": (None if ref_scorer is None else
                          {"model": reference.name, "kv_cache": reference.options.kv_cache}),  # type: ignore[union-attr]
            "seconds": round(time.perf_counter() - started, 3),
        })  # fmt: skip
        if policy.enabled:
            result["context_shifts"] = scorer.shifts
            result["discarded_tokens"] = scorer.discarded
        return result
    finally:
        llm.close()
        if reference is not None:
            reference.close()


def _score(ids: list[int], scorer: Any, ref: Any,
           progress: Callable[[int, int], None] | None) -> dict[str, Any]:  # fmt: skip
    """Feed ids[:-1] through `scorer` (and `ref` in step), predicting ids[1:]."""
    total = len(ids) - 1
    nll = ref_nll = 0.0
    kls: list[np.ndarray] = []
    agree = 0
    argmax: list[np.ndarray] = []
    pending: list[np.ndarray] = []  # reference rows not yet matched
    ref_pos = 0
    pos = 0
    while pos < total:
        piece = ids[pos : min(pos + scorer.chunk, total)]
        logp = _log_softmax(scorer.feed(piece))
        m = len(piece)
        targets = np.asarray(ids[pos + 1 : pos + 1 + m])
        nll -= float(logp[np.arange(m), targets].astype(np.float64).sum())
        argmax.append(logp.argmax(-1))
        if ref is not None:
            while sum(len(p) for p in pending) < m:
                rp = ids[ref_pos : min(ref_pos + ref.chunk, total)]
                pending.append(_log_softmax(ref.feed(rp)))
                ref_pos += len(rp)
            rows = np.concatenate(pending) if len(pending) > 1 else pending[0]
            r, pending = rows[:m], ([rows[m:]] if len(rows) > m else [])
            ref_nll -= float(r[np.arange(m), targets].astype(np.float64).sum())
            kls.append((np.exp(r) * (r - logp)).sum(-1, dtype=np.float64))
            agree += int((r.argmax(-1) == logp.argmax(-1)).sum())
        pos += m
        if progress is not None:
            progress(pos, total)
    out: dict[str, Any] = {"perplexity": math.exp(nll / total), "tokens": total,
                           "_argmax": np.concatenate(argmax)}  # fmt: skip
    if ref is not None:
        kl = np.concatenate(kls)
        out.update({"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                    "top1_agreement": agree / total,
                    "reference_perplexity": math.exp(ref_nll / total)})  # fmt: skip
    return out


def _acceptance(llm: Any, mode: str, ids: list[int], target: np.ndarray) -> dict[str, Any]:
    """How often the drafter's next token is the model's argmax (`target[i]`: after ids[:i+1])."""
    from localllm.engine.speculative import DRAFT_K, LOOKUP_K, Lookup

    total = len(target)
    if mode == "lookup":
        lookup = Lookup()
        guess = np.full(total, -1)
        for i in range(total):
            got = lookup.lookup(ids[: i + 1], 1)
            if got:
                guess[i] = got[0]
        k = LOOKUP_K
    else:
        if mode not in llm.capabilities.speculative:
            raise LocalLLMError(f"the {llm.runner.name} backend cannot measure speculative mode {mode!r}")
        drafted = llm.draft_argmax(mode, ids[:total])
        if drafted is None:
            return {"mode": mode, "proposed": 0, "coverage": 0.0, "acceptance": 0.0,
                    "tokens_per_pass": 1.0, "k": 0,
                    "note": "self does not pay on this model and device (tuned): it decodes plainly"}  # fmt: skip
        guess = np.asarray(drafted)
        k = llm.self_config().k if mode == "self" else DRAFT_K
    proposed = guess >= 0
    n = int(proposed.sum())
    alpha = float((guess[proposed] == target[proposed]).mean()) if n else 0.0
    per_pass = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
    return {"mode": mode, "proposed": n, "coverage": n / total, "acceptance": alpha, "k": k,
            "tokens_per_pass": per_pass}  # fmt: skip
