"""`localllm recommend`: which local model, with which KV cache and speculative setting, meets
the user's targets on this machine — measured here, not guessed.

Every candidate (a local model × a setting its backend offers) is measured once and the numbers
kept in the store (`measurements/<key>.json`, keyed by the file's digest, the setting and the
measurement's own parameters), so a second run only measures what is new:

- speed: `localllm bench` at one client (TTFT p95, decode tokens/s = 1 / median TPOT);
- quality: bits per character over the first `quality_chars` characters of the quality text
  (the one given, else a public-domain passage that ships with localllm): the perplexity's
  total log-loss spread over characters, so models with different tokenizers compare; and,
  among files of the same model (architecture, vocabulary, shape), KL divergence and top-1
  agreement against the largest of them — the best local version;
- memory: the backend's fit estimate at the measured context.

Candidates meeting every target come first, ranked by quality (bits per character, to 0.01)
and then by cost (USD per million tokens when a price is given, else tokens/s); the rest follow
with the target each one misses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.bench import default_quality_text
from localllm.errors import Cancelled, LocalLLMError, ModelNotFound

__all__ = ["Targets", "Setting", "candidates", "recommend", "default_quality_text"]

MEASURE_VERSION = 1  # bump when what a measurement means changes: old ones are measured again


@dataclass(frozen=True)
class Targets:
    max_ttft_s: float | None = None  # TTFT p95 at one client
    min_tokens_per_s: float | None = None  # decode tokens/s at one client
    max_memory_bytes: float | None = None  # the fit estimate

    def misses(self, row: dict[str, Any]) -> list[str]:
        """Which targets `row` misses, in words."""
        out = []
        if self.max_memory_bytes is not None and row["memory_bytes"] > self.max_memory_bytes:
            out.append(f"memory {row['memory_bytes'] / 1e9:.2f} GB > {self.max_memory_bytes / 1e9:g} GB")
        if self.max_ttft_s is not None and row.get("ttft_p95_s") is not None and row["ttft_p95_s"] > self.max_ttft_s:
            out.append(f"TTFT p95 {row['ttft_p95_s']:.2f} s > {self.max_ttft_s:g} s")
        if (self.min_tokens_per_s is not None and row.get("tokens_per_s") is not None
                and row["tokens_per_s"] < self.min_tokens_per_s):  # fmt: skip
            out.append(f"{row['tokens_per_s']:.1f} tokens/s < {self.min_tokens_per_s:g}")
        return out


@dataclass(frozen=True)
class Setting:
    backend: str
    kv_cache: str = "f16"
    speculative: str = "off"

    def label(self) -> str:
        return f"{self.backend}, KV {self.kv_cache}" + (
            f", speculative {self.speculative}" if self.speculative != "off" else "")  # fmt: skip


def settings_for(backend: str) -> list[Setting]:
    """What is worth comparing on a backend: its plain f16 cache, its 8-bit cache, and prompt
    lookup decoding where it has it (tokens/s only: greedy output is the same)."""
    from localllm import backends

    spec = backends.describe(backend)
    caps = spec.capabilities
    out = [Setting(spec.name)]
    eight = next((t for t in ("q8_0", "int8") if t in caps.kv_cache_types), None)
    if eight:
        out.append(Setting(spec.name, eight))
    if "lookup" in caps.speculative:
        out.append(Setting(spec.name, "f16", "lookup"))
    return out


def candidates(records: Sequence[Any], backend_names: Sequence[str]) -> list[tuple[Any, Setting]]:
    """Every local model × the settings of each backend that suits its file."""
    from localllm import backends
    from localllm.engine.core import head_path
    from localllm.models_registry.store import Store

    store = Store()
    out = []
    for record in records:
        path = store.path_of(record)
        for name in backend_names:
            spec = backends.describe(name)
            if spec.suits(path) is not None or not spec.available().ok:
                continue
            out += [(record, s) for s in settings_for(name)]
            if "head" in spec.capabilities.speculative and head_path(store.home, record.digest).exists():
                out.append((record, Setting(spec.name, "f16", "head")))  # its trained draft head
    return out


def _family(info: Any) -> tuple[Any, ...]:
    """Files of the same model (quantized differently): architecture, vocabulary and shape."""
    return (info.architecture, info.vocab_size, info.n_layers, info.n_embd, info.n_ff)


def _cache_path(key: dict[str, Any]) -> Path:
    from localllm.models_registry.store import Store

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Store().home / "measurements" / f"{digest}.json"


def _cached(key: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """The measurement for `key` from the store, else measured now and kept (temp file, rename)."""
    path = _cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return data["value"], True
    except (OSError, ValueError, AttributeError):
        pass
    value = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "value": value}))
    os.replace(tmp, path)
    return value, False


def recommend(targets: Targets, *, backend: str = "all", quality_text: str | None = None,
              quality_chars: int = 2000, prompt_tokens: int = 128, gen_tokens: int = 32,
              price: Any = None, models: Sequence[str] | None = None,
              progress: Callable[[str], None] | None = None,
              cancel: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
    """Measure every candidate (or take its kept numbers) and rank them. Returns the report
    `--json` prints: `rows` best first, each with `meets` and `misses`."""
    from localllm import backends
    from localllm.bench import run_bench
    from localllm.evaluate import evaluate
    from localllm.models_registry.store import Store
    from localllm.types import LoadOptions

    store = Store()
    wanted = set()
    if models:
        from localllm.models_registry.catalog import ensure_local

        for m in models:  # catalog names too (`smollm2`), registered from a package if need be
            with contextlib.suppress(ModelNotFound):
                wanted.add(ensure_local(m, store).name)
    records = [r for r in store.list() if not models or r.name in wanted]
    if not records:
        raise LocalLLMError("no local models to compare: pull or import one first (`localllm list`)")
    names = list(backends.AUTO_ORDER) if backend == "all" else [backends.describe(backend).name]
    cands = candidates(records, names)
    if not cands:
        raise LocalLLMError(f"no backend here can run the local models ({', '.join(names)})")
    text = (quality_text if quality_text is not None else default_quality_text())[:quality_chars]
    if len(text) < 100:
        raise LocalLLMError(f"the quality text has {len(text)} characters: give one of at least 100")
    text_digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    ctx = prompt_tokens + gen_tokens + 64

    # the reference of each family: its largest file (the least quantized)
    refs: dict[tuple[Any, ...], Any] = {}
    for r in records:
        f = _family(r.info)
        if f not in refs or r.size > refs[f].size:
            refs[f] = r
    rows = []
    say = progress or (lambda _s: None)
    for i, (record, s) in enumerate(cands, 1):
        if cancel is not None and cancel.is_set():
            raise Cancelled("the comparison was cancelled")
        options = LoadOptions(backend=s.backend, kv_cache=s.kv_cache, ctx=ctx, parallel=1,
                              speculative=None if s.speculative == "off" else s.speculative)  # fmt: skip
        label = f"[{i}/{len(cands)}] {record.name} ({s.label()})"
        memory = backends.describe(s.backend).estimate(record.info, options).total_bytes
        row: dict[str, Any] = {"model": record.name, "backend": s.backend, "kv_cache": s.kv_cache,
                               "speculative": s.speculative, "quant": record.info.quant,
                               "size_bytes": record.size, "memory_bytes": memory}  # fmt: skip
        if targets.max_memory_bytes is not None and memory > targets.max_memory_bytes:
            row["skipped"] = (f"memory {memory / 1e9:.2f} GB > {targets.max_memory_bytes / 1e9:g} GB: "
                              "not measured")  # fmt: skip
            rows.append(row)
            continue
        speed_key = {"v": MEASURE_VERSION, "what": "speed", "digest": record.digest, "backend": s.backend,
                     "kv": s.kv_cache, "speculative": s.speculative, "prompt": prompt_tokens,
                     "gen": gen_tokens}  # fmt: skip

        def speed(record: Any = record, options: LoadOptions = options, label: str = label) -> dict[str, Any]:
            say(f"{label}: measuring speed")
            b = run_bench(record.name, options=options, prompt_tokens=prompt_tokens,
                          gen_tokens=gen_tokens, concurrency=(1,), requests=3, price=None,
                          cancel=cancel)  # fmt: skip
            lv = b["levels"][0]
            return {"ttft_p95_s": lv["ttft_s"]["p95"], "ttft_p50_s": lv["ttft_s"]["p50"],
                    "tokens_per_s": lv["decode_tokens_per_s"], "prompt_tokens_per_s": lv["prompt_tokens_per_s"],
                    "ceiling_fraction": lv.get("ceiling_fraction")}  # fmt: skip

        try:
            sp, hit_speed = _cached(speed_key, speed)
        except Cancelled:
            raise
        except LocalLLMError as e:  # this setting cannot run this model here: say so, go on
            rows.append(row | {"skipped": f"cannot run: {e}"})
            continue
        ref = refs[_family(record.info)]
        # quality does not depend on the speculative mode (same greedy output): measured once
        quality_key = {"v": MEASURE_VERSION, "what": "quality", "digest": record.digest, "backend": s.backend,
                       "kv": s.kv_cache, "text": text_digest, "ref": ref.digest}  # fmt: skip

        def quality(record: Any = record, s: Setting = s, ref: Any = ref, label: str = label) -> dict[str, Any]:
            say(f"{label}: measuring quality")
            # a character is at least one token's worth (byte-level at worst), plus BOS
            n_ctx = min(len(text.encode()) + 8, record.info.context_length or 4096)
            opts = LoadOptions(backend=s.backend, kv_cache=s.kv_cache, ctx=n_ctx, parallel=1)
            same = ref.digest == record.digest and s.kv_cache == "f16"
            e = evaluate(record.name, text, options=opts, limit=n_ctx, ref=None if same else ref.name,
                         ref_kv=None if same else "f16")  # fmt: skip
            nats = e["tokens"] * math.log(e["perplexity"])  # "tokens": those predicted
            return {"perplexity": e["perplexity"], "bits_per_char": nats / math.log(2) / len(text),
                    "kl_mean": 0.0 if same else e.get("kl_mean"),
                    "top1_agreement": 1.0 if same else e.get("top1_agreement"),
                    "reference": ref.name, "tokens": e["tokens"]}  # fmt: skip

        try:
            q, hit_quality = _cached(quality_key, quality)
        except LocalLLMError as e:
            rows.append(row | sp | {"skipped": f"quality not measured: {e}"})
            continue
        row |= sp | q | {"cached": hit_speed and hit_quality}
        if price is not None:
            row["usd_per_million_output"] = price.per_million(row["tokens_per_s"])
        rows.append(row)
    for row in rows:
        row["misses"] = [row["skipped"]] if "skipped" in row else targets.misses(row)
        row["meets"] = not row["misses"]

    def rank(row: dict[str, Any]) -> tuple[Any, ...]:
        measured = "skipped" not in row
        bpc = row.get("bits_per_char")
        cost = row.get("usd_per_million_output")
        speed_rank = cost if cost is not None else -(row.get("tokens_per_s") or 0.0)
        return (not row["meets"], not measured, round(bpc, 2) if bpc is not None else math.inf,
                speed_rank)  # fmt: skip

    rows.sort(key=rank)
    return {"targets": {"max_ttft_s": targets.max_ttft_s, "min_tokens_per_s": targets.min_tokens_per_s,
                        "max_memory_bytes": targets.max_memory_bytes},
            "quality_text": "given" if quality_text is not None else "built-in (Alice, chapter 1)",
            "quality_chars": len(text), "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
            "price": None if price is None else {"usd_per_hour": price.usd_per_hour, "basis": price.basis},
            "rows": rows}  # fmt: skip
