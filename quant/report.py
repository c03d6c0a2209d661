"""A quantization's quality report: perplexity, KL divergence (mean, p99) and top-1 agreement against
the source model on a text, with file size and bits per weight — `localllm eval MODEL --ref SOURCE`'s
numbers, kept beside the model (`reports/<digest>.json` in the store) so `show` can display them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError

__all__ = ["load_report", "quality_report", "report_path", "report_table", "save_report"]

DEFAULT_LIMIT = 1024  # tokens of the text evaluated unless told otherwise


def quality_report(model: str, source: str, text_path: Path, *, limit: int | None = DEFAULT_LIMIT,
                   file_type: str = "", bits_per_weight: float | None = None,
                   backend: str = "auto") -> dict[str, Any]:  # fmt: skip
    """Evaluate `model` against `source` (store names) on the first `limit` tokens of the text."""
    from localllm.evaluate import evaluate, read_text
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store
    from localllm.types import LoadOptions

    store = Store()
    text = read_text(Path(text_path))
    r = evaluate(model, text, options=LoadOptions(backend=backend), limit=limit, ref=source)
    out_rec, src_rec = ensure_local(model, store), ensure_local(source, store)
    return {
        "model": out_rec.name,
        "digest": out_rec.digest,
        "source": src_rec.name,
        "file_type": file_type,
        "text": Path(text_path).name,
        "tokens": r["tokens"],
        "backend": r["backend"],
        "perplexity": r["perplexity"],
        "source_perplexity": r["reference_perplexity"],
        "kl_mean": r["kl_mean"],
        "kl_p99": r["kl_p99"],
        "top1_agreement": r["top1_agreement"],
        "file_bytes": out_rec.size,
        "source_bytes": src_rec.size,
        "bits_per_weight": bits_per_weight,
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }


def report_path(home: Path, digest: str) -> Path:
    return Path(home) / "reports" / f"{digest}.json"


def save_report(home: Path, report: dict[str, Any]) -> Path:
    """Written beside the store's models, named by the model's digest (atomically)."""
    path = report_path(home, report["digest"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_report(home: Path, digest: str) -> dict[str, Any] | None:
    path = report_path(home, digest)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise LocalLLMError(f"the quality report {path} is unreadable: {e}") from None
    return data if isinstance(data, dict) else None


def report_table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The report as (label, value) rows for a terminal."""
    from localllm.model_info import human_bytes

    bpw = r.get("bits_per_weight")
    return [
        ("against", f"{r['source']} on {r['text']} ({r['tokens']:,} tokens, {r['backend']})"),
        ("perplexity", f"{r['perplexity']:.4f} (source {r['source_perplexity']:.4f}, "
                       f"{(r['perplexity'] / r['source_perplexity'] - 1) * 100:+.2f}%)"),
        ("KL divergence", f"mean {r['kl_mean']:.5f}, p99 {r['kl_p99']:.5f} nats"),
        ("top-1 agreement", f"{r['top1_agreement'] * 100:.2f}%"),
        ("size", f"{human_bytes(r['file_bytes'])} (source {human_bytes(r['source_bytes'])})"
                 + (f", {bpw:.2f} bits/weight" if bpw else "")),
    ]  # fmt: skip
