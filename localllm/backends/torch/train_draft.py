"""Training a draft head on this machine (issue 36): the frozen target reads text, the head learns
its features and next-token distributions (`draft_head.losses`), a checkpoint at a time.

    train(model, text, out, digest=..., minutes=30)     → the head's file `out`
    load_head(out, digest)                              → the DraftHead, or one line why not

The text is read in order in windows of `seq` tokens, `batch` windows a step, around again when
it ends; a held-out tail (every `held`-th window) measures the draft's agreement with the target.
Every `every` steps the head, the optimizer and the place in the text go to `out` + ".partial"
(written to a temporary file, fsynced, renamed): a run killed at any moment resumes from the last
checkpoint and takes the same steps an unkilled run would have (the data order and the updates
are deterministic). Files are safetensors (tensors, and JSON under the "localllm" metadata key:
no pickle is ever loaded); they record the model's digest, and a head is refused for another
model.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from localllm.backends.torch.draft_head import (
    DraftHead,
    Eagle3Head,
    features,
    frequent,
    losses,
    soft_labels,
    softcap,
)
from localllm.errors import LocalLLMError

__all__ = ["Progress", "head_rows", "load_head", "load_published", "read_published", "save_head", "train"]

# The layout of the file `train` writes. 2: features after the target's final norm (format 1's
# were read before it, and are refused: train the head again).
FORMAT = 2


@dataclass
class Progress:
    """Where a training run stands (what its progress bar shows)."""

    step: int
    tokens: int  # target tokens the head has trained on
    seconds: float  # training time, over every resumed run
    loss: float  # the last step's
    kl: float  # the last step's token loss less the target's entropy
    agree: float | None = None  # held-out: how often the draft's top token is the target's
    done: bool = False


def head_rows(model: nn.Module, vocab: torch.Tensor) -> torch.Tensor:
    """The target head's rows of `vocab`, (len(vocab), dim) float32, whatever layer holds it."""
    head = getattr(model.output, "inner", model.output)  # a RowsApart wrapper
    w = head.dequantize() if hasattr(head, "dequantize") else head.weight
    return w.detach().float()[vocab.to(w.device)]


class _Passes:
    """The frozen target over the text's windows: features (float16) and soft labels over the
    draft vocabulary, each window's computed once and kept while they fit in `budget` bytes
    (later epochs then cost the head's work alone)."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, vocab: torch.Tensor, top: int,
                 budget: int) -> None:  # fmt: skip
        self.model, self.windows, self.vocab, self.top = model, windows, vocab, top
        per = windows.shape[1] * (model.args.dim * 2 + top * 6)
        self.room = budget // per  # windows kept
        self.kept: dict[int, tuple[torch.Tensor, ...]] = {}

    def __call__(self, at: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Windows `at`: (embeddings of tokens 1.., features, (label ids, probabilities))."""
        new = [i for i in at if i not in self.kept]
        if new:
            feats, logits = features(self.model, self.windows[new])
            idx, p = soft_labels(logits, self.vocab, self.top)
            got = {i: (feats[j].half(), idx[j].int(), p[j].half()) for j, i in enumerate(new)}
            for i in new:
                if len(self.kept) < self.room:
                    self.kept[i] = got[i]
        else:
            got = {}
        rows = [self.kept.get(i) or got[i] for i in at]
        with torch.no_grad():
            emb = self.model.embed(self.windows[list(at)][:, 1:]).float()
        feats = torch.stack([r[0] for r in rows]).float()
        labels = (torch.stack([r[1] for r in rows]).long(), torch.stack([r[2] for r in rows]).float())
        return emb, feats, labels


def _new_head(model: nn.Module, vocab: torch.Tensor) -> DraftHead:
    a = model.args
    with torch.random.fork_rng(devices=[]):  # the same start for the same model and text,
        torch.manual_seed(0)  # and the caller's generator left as it was
        return DraftHead(a.dim, a.n_heads, a.n_kv_heads, a.ffn_dim, vocab, head_dim=a.head_dim,
                         rope_base=a.rope_base, eps=a.norm_eps)  # fmt: skip


def _save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """`tensors` and `meta` as safetensors at `path`: a temporary file, fsynced, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"localllm": json.dumps(meta)})  # fmt: skip
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _state(head: DraftHead, digest: str, **meta: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A head's tensors (its parameters and draft vocabulary) and what the file says of it."""
    tensors = {f"head.{k}": v for k, v in head.state_dict().items()}
    return tensors, {"format": FORMAT, "digest": digest, "config": head.config, **meta}


def save_head(head: DraftHead, path: Path, digest: str, **meta: Any) -> Path:
    """`head` as the head of the model whose digest is `digest`, at `path` (as `train` keeps it)."""
    _save(path, *_state(head, digest, **meta))
    return path


def train(model: nn.Module, text: Sequence[int], out: Path, *, digest: str,
          minutes: float | None = None, tokens: int | None = None, n_draft_vocab: int = 8192,
          seq: int = 256, batch: int = 4, held: int = 16, lr: float = 1e-3, every: int = 10,
          steps: int = 3, top: int = 32, warmup: int = 20, kept_bytes: int = 2 << 30,
          report: Callable[[Progress], None] | None = None) -> Path:  # fmt: skip
    """Train (or go on training) the head of `model` on `text` until `minutes` of training or
    `tokens` target tokens in all, whichever comes first; write it to `out`.

    Each epoch takes the training windows in an order of its own (seeded by its number); the
    target's passes over a window are kept for later epochs while `kept_bytes` allow. The
    learning rate warms up over `warmup` steps; `steps` tokens are drafted from every position
    (`DraftHead.unrolled`). Held-out agreement is measured at every checkpoint.

    Raises:
        LocalLLMError: a text shorter than two windows; a checkpoint of another model.
    """
    if minutes is None and tokens is None:
        raise ValueError("a training run needs a budget: minutes or tokens")
    windows = torch.as_tensor(list(text), dtype=torch.long)
    n = len(windows) // seq
    if n < 2:
        raise LocalLLMError(f"{len(windows)} tokens of text are too few to train a draft head on "
                            f"(at least {2 * seq})")  # fmt: skip
    windows = windows[: n * seq].view(n, seq)
    kept = torch.arange(n) % held == held - 1
    kept[-1] |= not bool(kept.any())  # a short text still holds one window out
    test, train_w = windows[kept][:4], windows[~kept]
    partial = out.with_name(out.name + ".partial")
    meta, tensors = _load(partial, digest) if partial.exists() else ({}, {})
    vocab = tensors["head.vocab"] if meta else frequent(train_w.flatten(), n_draft_vocab,
                                                        model.args.vocab_size)  # fmt: skip
    head = _new_head(model, vocab)
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    step, seen, seconds, agree = 0, 0, 0.0, None
    if meta:
        head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in tensors.items():
            if k.startswith("optimizer."):
                _, i, name = k.split(".", 2)
                state.setdefault(int(i), {})[name] = v
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        step, seen, seconds, agree = meta["step"], meta["tokens"], meta["seconds"], meta.get("agree")
    rows, cap = head_rows(model, vocab), softcap(model)
    passes = _Passes(model, train_w, vocab, top, kept_bytes)
    held_out = _Passes(model, test, vocab, top, kept_bytes)
    budget_s = math.inf if minutes is None else 60 * minutes
    budget_t = math.inf if tokens is None else tokens
    t0, last = time.monotonic() - seconds, None
    orders: dict[int, torch.Tensor] = {}

    def order(epoch: int) -> torch.Tensor:
        if epoch not in orders:
            orders.clear()
            orders[epoch] = torch.randperm(len(train_w), generator=torch.Generator().manual_seed(epoch))
        return orders[epoch]

    def measure() -> float:
        with torch.no_grad():
            return float(losses(head, *held_out(range(len(test))), rows, cap, steps=1)["agree"][0])

    def checkpoint() -> None:
        tensors, meta = _state(head, digest, step=step, tokens=seen, seconds=time.monotonic() - t0,
                               agree=agree)  # fmt: skip
        sd = opt.state_dict()
        for i, st in sd["state"].items():
            tensors.update({f"optimizer.{i}.{k}": v for k, v in st.items()})
        _save(partial, tensors, meta | {"param_groups": sd["param_groups"]})

    while seen < budget_t and time.monotonic() - t0 < budget_s:
        at = [int(order(i // len(train_w))[i % len(train_w)]) for i in range(step * batch, (step + 1) * batch)]
        emb, feats, labels = passes(at)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup))
        got = losses(head, emb, feats, labels, rows, cap, steps=steps)
        opt.zero_grad()
        got["loss"].backward()
        opt.step()
        step, seen = step + 1, seen + batch * seq
        if step % every == 0:
            agree = measure()
            checkpoint()
        last = Progress(step, seen, time.monotonic() - t0, float(got["loss"].detach()), float(got["kl"]),
                        agree)  # fmt: skip
        if report is not None:
            report(last)
    agree = measure()
    save_head(head, out, digest, step=step, tokens=seen, seconds=time.monotonic() - t0, agree=agree)
    partial.unlink(missing_ok=True)
    if report is not None:
        report(Progress(step, seen, time.monotonic() - t0, last.loss if last else math.nan,
                        last.kl if last else math.nan, agree, done=True))  # fmt: skip
    return out


def _load(path: Path, digest: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(what the file says, its tensors) of a head file or checkpoint of the model whose digest
    is `digest`; one line for anything else."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("localllm", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except Exception as e:  # noqa: BLE001 - a broken file is one line
        raise LocalLLMError(f"{path.name}: not a draft head ({type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0][:120]})") from None  # fmt: skip
    if isinstance(meta, dict) and meta.get("format") == 1:
        raise LocalLLMError(f"{path.name}: a draft head of an older localllm (it read other "
                            "features): train it again with `localllm train-draft`")  # fmt: skip
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LocalLLMError(f"{path.name}: not a draft head this version of localllm reads")
    if meta.get("digest") != digest:
        raise LocalLLMError(f"{path.name}: this draft head was trained for another model "
                            f"({str(meta.get('digest'))[:12]}, not {digest[:12]})")  # fmt: skip
    return meta, tensors


def load_head(path: Path, digest: str) -> DraftHead:
    """The trained head in `path` for the model whose digest is `digest`."""
    meta, tensors = _load(path, digest)
    c = meta["config"]
    kind = c.get("kind", "eagle")
    if kind not in ("eagle", "eagle3"):
        raise LocalLLMError(f"{path.name}: a draft head of a kind this version does not read ({kind})")
    args = (c["dim"], c["n_heads"], c["n_kv_heads"], c["ffn_dim"], tensors["head.vocab"])
    kw = {"head_dim": c["head_dim"], "rope_base": c["rope_base"], "eps": c["eps"]}
    head = (DraftHead(*args, **kw) if kind == "eagle" else
            Eagle3Head(*args, **kw, taps=c["taps"], target_dim=c["target_dim"],
                       rope_scaling=c.get("rope_scaling"),
                       norm_before_residual=c["norm_before_residual"]))  # fmt: skip
    head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
    head.meta = meta  # type: ignore[assignment]  # what the file says: steps, tokens, agreement
    return head.eval()


# EAGLE-1's published layout (SafeAILab/EAGLE `cnets.py`): one Llama decoder layer whose input
# norm is left out, behind `fc`; our names for its tensors (q|k|v and gate|up are fused here).
_EAGLE = {
    "fc.weight": "fc.weight", "fc.bias": "fc.bias",
    "layers.0.self_attn.o_proj.weight": "wo.weight",
    "layers.0.mlp.down_proj.weight": "w2.weight",
    "layers.0.post_attention_layernorm.weight": "norm.weight",
}  # fmt: skip
_FUSED = {
    "wqkv.weight": ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                    "layers.0.self_attn.v_proj.weight"),
    "w13.weight": ("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"),
}  # fmt: skip


def load_published(folder: Path, n_vocab: int, n_layers: int = 0) -> DraftHead:
    """An EAGLE head as its authors publish it: `config.json` (a Llama config of one layer) and
    `model.safetensors`, for a target with `n_vocab` tokens (and `n_layers`): EAGLE-1's (fc and
    one decoder layer; it drafts over the whole vocabulary) or EAGLE-3's (`Eagle3Head`).

    Raises:
        LocalLLMError: one line for a missing or unreadable file, a pickle (`pytorch_model.bin`:
            never loaded; convert it to safetensors), a tensor missing or of the wrong shape.
    """
    weights = folder / "model.safetensors"
    if not weights.exists():
        why = ("pytorch_model.bin is a pickle, which localllm never loads: convert it to "
               "model.safetensors") if (folder / "pytorch_model.bin").exists() else "no model.safetensors"  # fmt: skip
        raise LocalLLMError(f"{folder.name}: {why}")
    return read_published(folder / "config.json", weights, n_vocab, folder.name, n_layers)


def read_published(config: Path, weights: Path, n_vocab: int, name: str,
                   n_layers: int = 0) -> DraftHead:  # fmt: skip
    """`load_published` of a head whose two files are these (a download's, named otherwise);
    `n_layers`: the target's (where an EAGLE-3 head's config names no layers to read)."""
    try:
        c = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LocalLLMError(f"{name}: no readable config.json ({type(e).__name__})") from None
    if not isinstance(c, dict):
        raise LocalLLMError(f"{name}: config.json is not a Llama config")
    vocab = c.get("vocab_size")
    if isinstance(vocab, int) and vocab != n_vocab:
        raise LocalLLMError(f"{name}: a head for a model of {vocab:,} tokens, not {n_vocab:,}")
    try:
        with safe_open(str(weights), "pt") as f:
            tensors = {k.removeprefix("model."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 - a broken file is one line
        raise LocalLLMError(f"{name}: model.safetensors cannot be read ({type(e).__name__})") from None
    if any(k.startswith("midlayer.") or k in ("d2t", "t2d") for k in tensors):
        return _eagle3(c, tensors, n_vocab, name, n_layers)
    try:
        dim, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        head = DraftHead(dim, heads, int(c.get("num_key_value_heads") or heads),
                         int(c["intermediate_size"]), torch.arange(n_vocab),
                         head_dim=int(c.get("head_dim") or dim // heads),
                         rope_base=float(c.get("rope_theta", 10000.0)),
                         eps=float(c.get("rms_norm_eps", 1e-6)))  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise LocalLLMError(f"{name}: config.json is not a Llama config ({type(e).__name__}: {e})") from None
    tensors.setdefault("fc.bias", torch.zeros(dim))  # some heads were trained without one
    return _filled(head, tensors, _EAGLE, _FUSED, name, "EAGLE-1")


def _filled(head: DraftHead, tensors: dict[str, torch.Tensor], names: dict[str, str],
            fused: dict[str, tuple[str, ...]], name: str, layout: str) -> DraftHead:  # fmt: skip
    """`head` with the published `tensors` loaded, by their `names` and `fused` parts; one line
    for a tensor missing or of another shape."""
    state = {ours: tensors[theirs] for theirs, ours in names.items() if theirs in tensors}
    for ours, parts in fused.items():
        if all(p in tensors for p in parts):
            state[ours] = torch.cat([tensors[p] for p in parts])
    state["vocab"] = head.vocab
    want = head.state_dict()
    for k, t in want.items():
        if k not in state:
            raise LocalLLMError(f"{name}: model.safetensors has no tensor for {k} ({layout} layout)")
        if state[k].shape != t.shape:
            raise LocalLLMError(f"{name}: {k} has shape {list(state[k].shape)}, the config says "
                                f"{list(t.shape)}")  # fmt: skip
    head.load_state_dict({k: state[k].float() for k in want})
    return head.eval()


# EAGLE-3's published layout (SafeAILab/EAGLE, as vLLM loads it): `midlayer` is the one decoder
# layer, `d2t` the draft vocabulary's offsets to target ids, `t2d` its inverse (not needed here)
_EAGLE3 = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "embed_norm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.self_attn.o_proj.weight": "wo.weight",
    "midlayer.post_attention_layernorm.weight": "norm.weight",
    "midlayer.mlp.down_proj.weight": "w2.weight",
    "norm.weight": "out_norm.weight",
    "lm_head.weight": "lm_head.weight",
}  # fmt: skip
_FUSED3 = {ours: tuple(p.replace("layers.0.", "midlayer.") for p in parts) for ours, parts in _FUSED.items()}


def _eagle3(c: dict[str, Any], tensors: dict[str, torch.Tensor], n_vocab: int, name: str,
            n_layers: int) -> Eagle3Head:  # fmt: skip
    """An EAGLE-3 head from its config and tensors (`read_published`)."""
    eagle = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    taps = eagle.get("eagle_aux_hidden_state_layer_ids")
    if taps is None:  # EAGLE-3's own choice: going into layers 2, L/2 and L - 3
        if n_layers < 6:
            raise LocalLLMError(f"{name}: an EAGLE-3 head reads three layers of a deeper model "
                                f"than one of {n_layers}")  # fmt: skip
        taps = [2, n_layers // 2, n_layers - 3]
    try:
        dim, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        draft = int(c.get("draft_vocab_size") or n_vocab)
        d2t = tensors.get("d2t", torch.zeros(draft, dtype=torch.long)).long()
        vocab = torch.arange(draft) + d2t
        if len(vocab) != draft or int(vocab.min()) < 0 or int(vocab.max()) >= n_vocab:
            raise ValueError("d2t maps draft tokens outside the model's vocabulary")
        taps = [int(t) for t in taps]
        if len(taps) != 3 or (n_layers and not all(0 <= t < n_layers for t in taps)):
            raise ValueError(f"layers {taps} to read of {n_layers}")
        head = Eagle3Head(dim, heads, int(c.get("num_key_value_heads") or heads),
                          int(c["intermediate_size"]), vocab, taps=taps,
                          target_dim=int(c.get("target_hidden_size") or dim),
                          head_dim=int(c.get("head_dim") or dim // heads),
                          rope_base=float(c.get("rope_theta", 10000.0)),
                          eps=float(c.get("rms_norm_eps", 1e-6)),
                          rope_scaling=c.get("rope_scaling") or None,
                          norm_before_residual=bool(c.get("norm_before_residual", False)))  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise LocalLLMError(f"{name}: not an EAGLE-3 config ({type(e).__name__}: {e})") from None
    return _filled(head, tensors, _EAGLE3, _FUSED3, name, "EAGLE-3")  # type: ignore[return-value]
