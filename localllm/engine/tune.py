"""Tuning the `self` drafter: which layers to skip and how far to draft, by measured tokens/s.

Draft & Verify (arXiv 2309.08168) and SWIFT (2410.06916) pick the skipped layers by search on a
short text; so does this, in three stages, each cheaper than the next:

1. A calibration text: a built-in prompt and the model's own greedy continuation of it (what a
   draft must agree with is the model's choice, not the text's).
2. Agreement: with teacher forcing, one forward of the whole text per skip set gives the share of
   positions where the skipping model's argmax is the full model's (greedy acceptance α). Single
   layers are ranked by it; skip sets grow from the least harmful, trying a few candidates at each
   size and keeping the best.
3. Speed: the most promising (skip set, draft length) pairs — by the predicted tokens per second,
   (1 − α^(k+1)) / (1 − α) tokens per pass at a cost of k draft passes plus one target pass —
   generate for real, each right after a plain generation (a shared machine drifts by more than
   the gains sought), and the fastest is measured twice more. A candidate whose best case (its
   measured tokens per round at the cost model's lowest price) is below 1 cannot pay, however
   fast one run looked. When the median of the fastest's three does not beat plain decoding by
   `PAYS` the result says so (`pays` False) and `self` decodes plainly on this model and device.

The result is kept per model file (its digest) and device in the store (`tuned/`), so it runs once.

`tune_head` measures the same way whether a model's draft head (`--speculative head`) should
draft trees or a chain on this device (`localllm tune` runs it where the model has a head); until
it has, the engine decides by the measured cost of a verified token (`speculative.TREE_COST`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SelfConfig", "cached_or_tuned", "stored_head", "tune", "tune_head"]

# A public-domain opening (Jane Austen, Pride and Prejudice) for the model to continue.
CALIBRATION_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters."
)
VERSION = 2  # of the search: a stored result from another version is searched again
PAYS = 1.05  # a candidate must beat plain decoding by this much (timing noise is a few percent)


@dataclass(frozen=True)
class SelfConfig:
    """The `self` drafter for one model and device."""

    skip: tuple[int, ...] = ()
    k: int = 1
    confidence: float = 0.0
    pays: bool = False  # whether it beat plain decoding when measured
    speedup: float = 0.0  # its tokens/s over plain decoding's, as measured
    acceptance: float = 0.0  # greedy agreement with the full model on the calibration text
    table: list[dict[str, Any]] = field(default_factory=list)  # every candidate the search measured
    grown: list[dict[str, Any]] = field(default_factory=list)  # the skip sets grown, with agreement


def device_key(llm: Any) -> str:
    """Which device a result was measured on: its name (on the CPU, with its vector extensions:
    the same file may move between CPUs), the working precision and the threads."""
    r = llm.runner
    return f"{r.device_name}/{r.dtype}/{r.n_threads}t"


def cached_or_tuned(llm: Any, *, report: Callable[[str], None] | None = None) -> SelfConfig:
    """The stored result for this model (an engine `Model`) and device, else a search (stored
    when it can be)."""
    path: Path | None = llm.tuned_path
    key = device_key(llm)
    stored = _read(path).get(key) if path else None
    if isinstance(stored, dict) and stored.get("version") == VERSION:
        try:
            return SelfConfig(**{k: tuple(v) if k == "skip" else v for k, v in stored.items()
                                 if k != "version"})  # fmt: skip
        except TypeError:
            pass  # written by another layout: search again
    config = tune(llm, report=report)
    if path is not None:
        save(path, key, config)
    return config


def _read(path: Path | None) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(path: Path, key: str, config: SelfConfig | dict[str, Any]) -> None:
    """Written whole to a temporary file, then renamed: a kill leaves the old file or the new.
    A dict (`tune_head`'s) is kept as it is."""
    data = _read(path)
    data[key] = config if isinstance(config, dict) else {"version": VERSION, **asdict(config)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable store tunes again next time; the answer is the same


def _argmax(llm: Any, ids: Sequence[int], skip: Sequence[int]) -> Any:
    """Teacher-forced argmax after every token of `ids` with `skip` left out: (len(ids),)."""
    from localllm.engine.scoring import teacher_argmax

    with llm.slot_for_work() as sid:
        return teacher_argmax(llm.runner, ids, skip=frozenset(skip), slot=sid)


def tune(llm: Any, *, report: Callable[[str], None] | None = None, gen_tokens: int = 48,
         max_skip: float = 0.6, tries: int = 3, measure: int = 6, confirm: int = 2) -> SelfConfig:  # fmt: skip
    """Search the skip set and draft length that maximise measured tokens/s (see the module).

    Args:
        gen_tokens: tokens of the calibration continuation, and of every timed generation.
        max_skip: the largest share of layers a draft may leave out.
        tries: candidates tried at each skip-set size (from the ranked single layers).
        measure: (skip set, k) pairs generated for real, each beside a plain generation.
        confirm: further side-by-side measurements of the fastest; the median decides.
    """
    return _tune(llm, report or (lambda _line: None), gen_tokens, max_skip, tries, measure, confirm)


def _tune(b: Any, say: Callable[[str], None], gen_tokens: int, max_skip: float, tries: int,
          measure: int, confirm: int) -> SelfConfig:  # fmt: skip
    from localllm.engine.speculative import LayerSkip, Pace

    n_layers = b.runner.n_layers
    prompt = b.tokenize(CALIBRATION_PROMPT)
    plain_ids, plain_s = _generate(b, prompt, gen_tokens)
    text = prompt + plain_ids
    t0 = time.perf_counter()
    full = _argmax(b, text, ())
    forward_s = time.perf_counter() - t0
    span = slice(len(prompt) - 1, len(text) - 1)  # positions whose next token was generated

    def agreement(skip: Sequence[int]) -> float:
        got = _argmax(b, text, skip)
        return float((got[span] == full[span]).mean())

    say(f"calibration: {len(prompt)} prompt + {len(plain_ids)} generated tokens; plain decoding "
        f"{len(plain_ids) / plain_s:.1f} tokens/s; {n_layers} layers, one pass over the text "
        f"{forward_s * 1000:.0f} ms")  # fmt: skip
    single = {i: agreement((i,)) for i in range(n_layers)}
    order = sorted(single, key=lambda i: (-single[i], i))
    say("agreement with one layer skipped: "
        + ", ".join(f"{i}:{single[i]:.2f}" for i in order))  # fmt: skip
    sets: list[tuple[tuple[int, ...], float]] = []
    current: tuple[int, ...] = ()
    for _size in range(1, max(1, int(max_skip * n_layers)) + 1):
        options = [i for i in order if i not in current][:tries]
        scored = [(tuple(sorted((*current, i))), 0.0) for i in options]
        scored = [(s, agreement(s)) for s, _ in scored]
        current, alpha = max(scored, key=lambda x: x[1])
        sets.append((current, alpha))
        say(f"skip {len(current):2d} layers {list(current)}: agreement {alpha:.2f}")

    def predicted(skip: tuple[int, ...], alpha: float, k: int) -> float:
        """Tokens per plain-pass time: a draft pass costs its share of layers, verifying one."""
        per_pass = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        draft = (n_layers - len(skip)) / n_layers
        return per_pass / (k * draft + 1.0)

    candidates = sorted(((predicted(s, a, k), s, a, k) for s, a in sets for k in (1, 2, 3, 4, 6)),
                        reverse=True)[:measure]  # fmt: skip
    table: list[dict[str, Any]] = []

    def pair(skip: tuple[int, ...], k: int) -> tuple[float, float, bool, float]:
        """Plain decoding, then the candidate: (candidate tokens/s, plain tokens/s, same text,
        best case). Side by side, so both see the machine in the same state (a shared machine's
        speed drifts by more than the gains sought). The best case is the speed-up the candidate's
        measured tokens per round would give were verifying k tokens as cheap as one plain pass
        and a draft pass its share of layers: where that is below 1 nothing can pay, and a faster
        measurement is noise."""
        plain_out, plain_s = _generate(b, prompt, gen_tokens)
        pace = Pace(k, k)
        ids, secs = _generate(b, prompt, gen_tokens, drafter=LayerSkip(b.runner, skip),
                              pace=pace)  # fmt: skip
        best_case = 0.0
        if pace.rounds:
            per_round = (pace.accepted + pace.rounds) / pace.rounds
            best_case = per_round / (
                1 + pace.drafted / pace.rounds * (n_layers - len(skip)) / n_layers
            )
        return len(ids) / secs, len(plain_out) / plain_s, ids == plain_ids[: len(ids)], best_case

    for pred, skip, alpha, k in candidates:
        rate, plain_rate, same, best_case = pair(skip, k)
        table.append({"skip": list(skip), "layers_skipped": len(skip), "k": k, "agreement": round(alpha, 3),
                      "predicted_speedup": round(pred, 3), "best_case": round(best_case, 3),
                      "tokens_per_s": round(rate, 2), "plain_tokens_per_s": round(plain_rate, 2),
                      "speedup": round(rate / plain_rate, 3), "same_text": same})  # fmt: skip
        say(f"skip {len(skip):2d} k={k}: agreement {alpha:.2f}, predicted {pred:.2f}x, best case "
            f"{best_case:.2f}x, measured {rate:.1f} tokens/s = {rate / plain_rate:.2f}x of plain "
            f"{plain_rate:.1f}")  # fmt: skip
    grown = [{"skip": list(skip), "agreement": round(alpha, 3)} for skip, alpha in sets]
    plain = SelfConfig(pays=False, speedup=1.0, table=table, grown=grown)
    eligible = [r for r in table if r["speedup"] > PAYS and r["best_case"] > 1]
    if not eligible:
        return plain
    # the fastest is measured `confirm` times more: one lucky pair does not make it pay
    row = max(eligible, key=lambda r: r["speedup"])
    skip, k = tuple(row["skip"]), row["k"]
    ratios = [row["speedup"]]
    for _ in range(confirm):
        rate, plain_rate, _same, _best = pair(skip, k)
        ratios.append(round(rate / plain_rate, 3))  # as the table has them
    speedup = sorted(ratios)[len(ratios) // 2]
    row["confirmed"] = ratios
    say(
        f"skip {len(skip):2d} k={k} again: "
        + ", ".join(f"{r:.2f}x" for r in ratios[1:])
        + f"; median {speedup:.2f}x "
        + ("pays" if speedup > PAYS else f"does not beat plain by {PAYS}x")
    )
    if speedup <= PAYS:
        return plain
    return SelfConfig(skip=skip, k=k, pays=True, speedup=speedup, acceptance=row["agreement"], table=table,
                      grown=grown)  # fmt: skip


HEAD_VERSION = 1  # of `tune_head`'s measurement


def stored_head(llm: Any) -> dict[str, Any] | None:
    """What `tune_head` measured for this model and device, if it has."""
    path: Path | None = llm.tuned_path
    got = _read(path).get(device_key(llm) + "/head") if path else None
    return got if isinstance(got, dict) and got.get("version") == HEAD_VERSION else None


def tune_head(b: Any, *, report: Callable[[str], None] | None = None, gen_tokens: int = 96,
              repeats: int = 3) -> dict[str, Any]:  # fmt: skip
    """Whether the model's draft head drafts trees (`speculative.TREE_WIDTH` branches a node,
    `TREE_NODES` tokens) or a chain here: plain decoding, the chain and the tree generate the
    calibration continuation side by side `repeats` times; the tree when its median speed-up
    beats the chain's. Kept under the device's key + "/head" (`stored_head`)."""
    from localllm.engine.speculative import HEAD_K, TREE_NODES, TREE_WIDTH, HeadDrafter, Pace

    say = report or (lambda _line: None)
    b.use_head()
    prompt = b.tokenize(CALIBRATION_PROMPT)
    ratios: dict[str, list[float]] = {"chain": [], "tree": []}
    for _ in range(repeats):
        plain, plain_s = _generate(b, prompt, gen_tokens)
        for name, width in (("chain", 1), ("tree", TREE_WIDTH)):
            drafter = HeadDrafter(b.runner, lookup=True, width=width, nodes=TREE_NODES)
            ids, secs = _generate(b, prompt, gen_tokens, drafter=drafter,
                                  pace=Pace(HEAD_K, HEAD_K // 2, give_up=False))  # fmt: skip
            ratios[name].append(round(len(ids) / secs / (len(plain) / plain_s), 3))
    median = {k: sorted(v)[len(v) // 2] for k, v in ratios.items()}
    tree = median["tree"] > median["chain"]
    say(f"head: a chain {median['chain']:.2f}x, a tree of {TREE_NODES} ({TREE_WIDTH} a node) "
        f"{median['tree']:.2f}x of plain decoding: it drafts {'trees' if tree else 'a chain'}")  # fmt: skip
    return {"version": HEAD_VERSION, "tree": tree, "chain_speedup": median["chain"],
            "tree_speedup": median["tree"], "runs": ratios}  # fmt: skip


def _generate(b: Any, prompt: Sequence[int], n: int, *, drafter: Any = None,
              pace: Any = None) -> tuple[list[int], float]:  # fmt: skip
    """Greedy tokens after `prompt` through the engine's own steps (`Model.generate_here`), and
    the seconds the decode took (after the first token), with `drafter` and `pace` when given."""
    return b.generate_here(prompt, n, drafter=drafter, pace=pace)
