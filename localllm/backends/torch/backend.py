"""The torch engine as a slot backend (`localllm.backends.base.Backend`) the engine's scheduler drives.

Each slot owns one plain cache per layer (`cache.KVCache`, position-indexed), its row of that
layer's `cache.Rows` (every slot's buffers in one tensor, growing in steps for the longest): a step
evaluates every prefilling sequence's chunk on its own (in pieces of at most `max_batch` tokens, so
peak memory does not grow with the prompt), then every decoding sequence together as one (B, 1)
batch that attends over the rows in one call per layer, each row masked to its own length. A slot
keeps its cache after release, and the next prompt that continues it reuses the shared prefix
(trimmed, not copied); the prefix cache (`localllm.prefix_cache`) keeps blocks across slots.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from localllm.backends import TORCH
from localllm.backends.base import Seq, Step, common_prefix
from localllm.backends.torch.cache import KVCache, Rows
from localllm.backends.torch.sampling import Sampler, logprobs, make_sampler
from localllm.chat import template_for
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.memory import parse_kv_cache
from localllm.types import ContextPolicy, speculative_mode

__all__ = ["TorchBackend", "open_backend", "resolve_device", "resolve_dtype"]

_KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# The CPU's default working precision: the fastest path measured here that keeps KL ≤ 0.01 nats
# and top-1 ≥ 99% against f32 (bench/torch_gemv.py, bench/torch_engine.py; numbers in the issue
# 11 note): the file's 4-bit feed-forward matrices kept 4-bit in torch's int4 matmul
# (`quantized.Int4Linear`), every other projection fp16 in fbgemm's GEMM (`quantized.Fp16Linear`).
CPU_DEFAULT_DTYPE = "int4"
LOOKUP_K = 10  # the most tokens prompt lookup proposes in one pass
DRAFT_K = 8  # ... and a draft model


def resolve_device(name: str = "auto") -> torch.device:
    """auto: cuda > mps > cpu. A named device that torch does not see is one line."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("torch sees no CUDA device here (--device cuda); use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise LocalLLMError("torch sees no Apple Metal (MPS) device here; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> tuple[str, torch.dtype]:
    """The working precision and the dtype activations are computed in.

    f32 is the exact reference path (the oracle tests'). On a GPU bf16/f16 weights and compute
    (auto: bf16 on CUDA, f16 on MPS). On the CPU, f16 means fp16 *weights* with f32 compute
    (`quantized.Fp16Linear`), int4 (the default there) the same with the file's 4-bit
    feed-forward matrices kept 4-bit (`quantized.Int4Linear`; where torch lacks the kernel they
    are fp16 too), and bf16 is bf16 throughout (fast only where the CPU has native bf16 dot
    products).
    """
    if name == "auto":
        name = {"cuda": "bf16", "mps": "f16"}.get(device.type, CPU_DEFAULT_DTYPE)
    if name == "int4":
        if device.type != "cpu":
            raise LocalLLMError(f"int4 is the CPU's working precision; on {device.type} use "
                                "--dtype bf16 or f16")  # fmt: skip
        return name, torch.float32
    if name not in _KV_DTYPES:
        raise LocalLLMError(f"the torch engine has no {name} working precision "
                            "(f32, bf16, f16, int4)")  # fmt: skip
    if name == "bf16" and device.type == "mps" and not torch.backends.mps.is_macos_or_newer(14, 0):
        raise LocalLLMError("bf16 on Apple Metal needs macOS 14; use --dtype f16")
    if name == "f16" and device.type == "cpu":
        return name, torch.float32
    return name, _KV_DTYPES[name]


# -- one thread for torch's work ----------------------------------------------------------------
# OpenMP gives every thread that starts parallel work its own team of workers. Loading on the
# caller's thread and decoding on the engine's scheduler thread made two teams contend for the
# cores: SmolLM2 decoded at 21.5 ms/token on the scheduler thread against 14.3 on the loading
# thread (2 threads, 2 cores). So every backend's loading, steps and embeddings run on this one
# thread, whichever thread asks.

_compute = threading.local()


def _mark_compute_thread() -> None:
    _compute.here = True


def _new_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="localllm-torch",
                              initializer=_mark_compute_thread)  # fmt: skip


def _after_fork() -> None:
    global _EXECUTOR  # a forked child has no such thread: the old executor would wait forever
    _EXECUTOR = _new_executor()


_EXECUTOR = _new_executor()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def on_compute_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` on the torch thread and return (or raise) what it does there."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if getattr(_compute, "here", False):
            return fn(*args, **kwargs)
        return _EXECUTOR.submit(fn, *args, **kwargs).result()

    return run


class _Block:
    """A prefix-cache handle: every layer's (K, V) for a run of positions, (1, n_kv, T, hd) each."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = kv
        self.nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


@dataclass(eq=False)
class _Slot:
    sid: int
    caches: list[Any] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what the caches hold, in order
    seq: Seq | None = None
    sampler: Sampler | None = None
    fed: int = 0  # prompt tokens in the cache
    last: int | None = None  # sampled, not yet evaluated
    history: list[int] = field(default_factory=list)  # prompt + generated, for penalties
    policy: ContextPolicy = field(default_factory=ContextPolicy)  # what its caches were made for
    shifted: list[int] = field(default_factory=list)  # tokens forgotten, not yet reported
    drafter: Any = None  # the sequence's speculative drafter (`speculative`), None: off
    pace: Any = None  # its `speculative.Pace`
    draft: Any = None  # a draft model's (caches, tokens they hold), kept like `caches`

    @property
    def n_past(self) -> int:
        return self.caches[0].offset if self.caches else 0


class TorchBackend:
    """A model file on one torch device: tokenizer, stateless model, one cache set per slot."""

    name = "torch"
    capabilities = TORCH

    @on_compute_thread  # loading is torch work too
    def __init__(self, path: str | Path, *, n_ctx: int, n_slots: int = 1, max_batch: int = 256,
                 device: str = "auto", dtype: str = "auto", kv_cache: str = "f16",
                 evict: str | None = None, threads: int | None = None,
                 speculative: str | None = None, draft: tuple[str, str | Path] | None = None,
                 tuned: Path | None = None) -> None:  # fmt: skip
        """Args:
        n_ctx: tokens per sequence.
        n_slots: sequences held at once.
        max_batch: prompt tokens one forward evaluates (the prefill piece: bounds peak memory).
        device, dtype: see `resolve_device`, `resolve_dtype`.
        kv_cache: the cache's types, `TYPE` or `k=TYPE,v=TYPE` (f16, bf16, f32, or int8, fp8,
            int4, int2 codes: `kvquant`); attention computes in the working dtype.
        evict: `h2o:BUDGET` (`policies.H2OCache`) or None. StreamingLLM is per sequence
            (`Seq.policy`).
        speculative: the sequences' default mode (off, lookup, self, draft:MODEL); a sequence
            may ask for another (`Seq.speculative`), but `draft:` only for the loaded draft.
        draft: (name, path) of the draft model `draft:NAME` loads (same vocabulary, checked).
        tuned: where the `self` drafter's tuned skip set for this file and device is kept.
        """
        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        self.dtype, self.compute_dtype = resolve_dtype(dtype, self.device)
        from localllm.backends.torch.kvquant import CODECS

        self.kv_types = parse_kv_cache(kv_cache)
        for t in self.kv_types:
            if t not in CODECS:
                raise LocalLLMError(f"the torch backend has no {t} KV cache "
                                    f"(it has {', '.join(CODECS)})")  # fmt: skip
        self.budget = int(evict.partition(":")[2]) if evict else 0
        if evict and not evict.startswith("h2o:"):
            raise LocalLLMError(f"the torch backend has no {evict.partition(':')[0]} eviction (it has h2o)")
        # a plain cache of one float type is the fast path; the throwaway caches of embed() keep
        # that type, or the working dtype when the cache quantizes
        k = self.kv_types[0]
        self.kv_dtype = _KV_DTYPES[k] if k == self.kv_types[1] and k in _KV_DTYPES else self.compute_dtype
        linear = None
        if self.dtype in ("f16", "int4") and self.device.type == "cpu":
            from localllm.backends.torch.quantized import Fp16Linear, quantize_linear

            linear = quantize_linear if self.dtype == "int4" else Fp16Linear.from_float
        self.model_path = str(path)
        self._linear = linear
        self.tokenizer, self.model, meta = self._load(path)
        if self.budget:
            if any(getattr(layer.attention, "window", 0) for layer in self.model.layers):
                raise LocalLLMError("H2O eviction (--evict) needs every layer to attend to the whole "
                                    "cache; this model has sliding-window layers")  # fmt: skip
            if any(t in ("int4", "int2") for t in self.kv_types):
                raise LocalLLMError("H2O eviction keeps tokens one by one; int4 and int2 caches "
                                    "group them (use f16, bf16, f32, int8 or fp8)")  # fmt: skip
        tok = self.tokenizer
        self.chat_template = template_for(
            meta,
            bos_token=tok.piece(tok.bos_id) if tok.bos_id is not None and tok.bos_id >= 0 else "",
            eos_token=tok.piece(tok.eos_id) if tok.eos_id is not None and tok.eos_id >= 0 else "",
        )
        self.has_template = "tokenizer.chat_template" in meta
        args = self.model.args
        self.n_ctx = max(16, min(int(n_ctx), int(args.context_length or n_ctx)))
        self.n_slots = max(1, int(n_slots))
        self.max_batch = max(1, int(max_batch))
        self._slots = [_Slot(i) for i in range(self.n_slots)]
        self._rows: list[Rows] | None = None  # every slot's plain caches, per layer (`new_caches`)
        self._lock = threading.Lock()  # embed() may come from another thread than the scheduler's
        self.speculative = speculative if speculative_mode(speculative) != "off" else None
        self.tuned_path = tuned
        self._self_config: Any = None  # the `self` drafter's skip set, tuned once (`tune`)
        self.draft_name, self.draft_model = None, None
        if speculative_mode(speculative) == "draft" and draft is None:
            raise LocalLLMError(f"--speculative {speculative}: no draft model was given")
        if draft is not None:
            self.draft_name = draft[0]
            tok, self.draft_model, _ = self._load(draft[1])
            if tok.tokens != self.tokenizer.tokens:
                raise LocalLLMError(
                    f"the draft model {draft[0]} has another vocabulary ({len(tok.tokens)} tokens) "
                    f"than the model ({len(self.tokenizer.tokens)}): a draft must share it"
                )
        self._check_speculative(speculative, ContextPolicy())

    def _load(self, path: str | Path) -> tuple[Any, Any, dict[str, Any]]:
        """(tokenizer, model, metadata) of a GGUF file in this backend's precision and device."""
        from localllm.backends.torch.models import build_model
        from localllm.backends.torch.tokenizer import GGUFTokenizer
        from localllm.gguf_file import GGUFFile

        linear = self._linear
        with GGUFFile(path) as f:
            tokenizer = GGUFTokenizer.from_gguf(f)
            model = build_model(f, dtype=self.compute_dtype, device=self.device, linear=linear)
            if linear is not None:  # the head has its own fp16 copy: lookups read the file's rows
                from localllm.backends.torch.quantized import BlockEmbedding

                model.tok_embeddings = BlockEmbedding.from_gguf(f, "token_embd.weight",
                                                                self.compute_dtype)  # fmt: skip
            meta = dict(f.metadata)
        model.eval()
        return tokenizer, model, meta

    # -- tokens --------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    @property
    def n_vocab(self) -> int:
        return self.tokenizer.n_vocab

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def is_end(self, token: int) -> bool:
        return self.tokenizer.is_end(token)

    def bos_text(self) -> str:
        return self.chat_template.bos_token

    # -- slots ---------------------------------------------------------------------------------

    def new_caches(self, policy: ContextPolicy | None = None, slot: int | None = None) -> list[Any]:
        """One sequence's caches for `policy` (StreamingLLM) and this backend's types and H2O
        budget (`policies.make_caches`); plain ones for a `slot` are its row of the shared
        `cache.Rows`, others (a scorer's, the prefix budget's) have buffers of their own."""
        from localllm.backends.torch.policies import make_caches

        rows = None
        if slot is not None:
            if self._rows is None:
                a = self.model.args
                k = self.kv_types[0]
                self._rows = [Rows(self.n_slots, a.n_kv_heads, a.head_dim, self.n_ctx,
                                   dtype=_KV_DTYPES.get(k, self.compute_dtype), device=self.device)
                              for _ in range(a.n_layers)]  # fmt: skip
            rows = self._rows
        return make_caches(self.model, self.n_ctx, kv_types=self.kv_types, policy=policy,
                           budget=self.budget, dtype=self.compute_dtype, device=self.device,
                           rows=rows, slot=slot or 0)  # fmt: skip

    def scorer(self, policy: ContextPolicy | None = None) -> TorchScorer:
        """Logits for every position of a text through one sequence's caches (`localllm eval`)."""
        return TorchScorer(self, policy or ContextPolicy())

    # -- speculative decoding ------------------------------------------------------------------

    def _check_speculative(self, spec: str | None, policy: ContextPolicy) -> None:
        check_speculative(spec, policy=policy, budget=self.budget, draft_name=self.draft_name)

    def _drafter(self, seq: Seq) -> tuple[Any, Any]:
        """(drafter, pace) for a sequence's speculative mode; (None, None) when off."""
        from localllm.backends.torch import speculative as sp

        spec = seq.speculative if seq.speculative is not None else self.speculative
        self._check_speculative(spec, seq.policy)
        mode = speculative_mode(spec)
        if mode == "lookup":
            return sp.Lookup(), sp.Pace(LOOKUP_K, LOOKUP_K // 2, give_up=False)
        if mode == "draft":
            drafter = sp.DraftModel(self.draft_model, capacity=self.n_ctx, dtype=self.kv_dtype,
                                    device=self.device, chunk=self.max_batch)  # fmt: skip
            return drafter, sp.Pace(DRAFT_K, DRAFT_K // 2)
        if mode == "self":
            config = self.self_config()
            drafter = sp.LayerSkip(self.model, config.skip, device=self.device,
                                   confidence=config.confidence)  # fmt: skip
            return drafter, sp.Pace(max(1, config.k), on=config.pays)
        return None, None

    def self_config(self) -> Any:
        """The `self` drafter's skip set and draft length for this model and device: tuned once
        (`tune.tune`) and kept beside the store's models (`tuned`)."""
        if self._self_config is None:
            from localllm.backends.torch import tune

            self._self_config = tune.cached_or_tuned(self)
        return self._self_config

    @on_compute_thread
    @torch.inference_mode()
    def draft_argmax(self, mode: str, ids: Sequence[int]) -> Any:
        """The `self` or `draft` drafter's greedy choice after every token of `ids`, teacher-
        forced (numpy (len(ids),)), for `localllm eval --speculative`; None where `self` does not
        pay on this model and device (it then decodes plainly)."""
        if mode == "self":
            config = self.self_config()
            if not config.pays:
                return None
            model, skip = self.model, tuple(config.skip)
        else:
            model, skip = self.draft_model, ()
        caches = model.make_caches(len(ids) + 1, dtype=self.kv_dtype, device=self.device)
        out = []
        for i in range(0, len(ids), self.max_batch):
            x = torch.tensor([list(ids[i : i + self.max_batch])], dtype=torch.long, device=self.device)
            out.append(model.logits(model(x, [caches], skip=skip)[0]).argmax(-1))
        return torch.cat(out).cpu().numpy()

    def _speculate(self, slot: _Slot) -> list[Step]:
        """One decode pass of a speculating sequence: draft, verify in one target pass, keep
        what the exact rule accepts and trim the rest from the caches. Without a draft (none
        proposed, or a pass kept plain to measure plain decoding) it is a plain pass."""
        from localllm.backends.torch.speculative import Draft, accept

        seq, pace = slot.seq, slot.pace
        assert seq is not None and slot.sampler is not None and slot.last is not None
        t0 = time.perf_counter()
        k = min(pace.want(), self.n_ctx - slot.n_past - 1)
        if seq.sampling.max_tokens:
            k = min(k, seq.sampling.max_tokens - (len(slot.history) - len(seq.ids)) - 1)
        draft = slot.drafter.propose(slot, k) if k > 0 else Draft([])
        h = self._forward([slot], [[slot.last, *draft.tokens]])
        logits = self.model.logits(h[0]).float()  # (1 + drafts, V)
        if not draft.tokens:
            step = self._sample(slot, logits[-1])
            pace.plain(time.perf_counter() - t0)
            return [replace(step, passes=1)]
        history = slot.history
        start = len(history)
        tokens, n = accept(lambda i: logits[i], draft, slot.sampler, history)
        rejected = len(draft.tokens) - n
        if rejected:
            for c in slot.caches:
                c.trim(rejected)
            del slot.tokens[-rejected:]
        slot.last = tokens[-1]
        pace.verified(len(draft.tokens), n, time.perf_counter() - t0)
        steps = []
        want_lp = seq.sampling.logprobs
        for i, t in enumerate(tokens):
            lp, top = logprobs(logits[i], t, want_lp) if want_lp is not None else (None, ())
            steps.append(Step(t, logprob=lp, top=top))
        steps[0] = replace(steps[0], shifted=tuple(slot.shifted), passes=1,
                           drafted=len(draft.tokens), accepted=n)  # fmt: skip
        slot.shifted = []
        if not pace.on:
            steps[-1] = replace(steps[-1], spec_off=pace.reason)
        assert len(history) == start + len(tokens)
        return steps

    def _chunk(self, policy: ContextPolicy) -> int:
        """Prompt tokens one forward evaluates: under a policy that forgets, at most half of
        what it keeps, so every new token still sees most of its window."""
        keep = policy.window if policy.enabled else self.budget
        return max(1, min(self.max_batch, keep // 2)) if keep else self.max_batch

    def admit(self, seq: Seq) -> int:
        """Give `seq` a free slot (the one whose cache shares the longest prefix with its prompt,
        else an empty one, else the least useful) and return the prompt tokens reused."""
        free = [s for s in self._slots if s.seq is None]
        if not free:
            raise LocalLLMError(f"all {self.n_slots} torch slots are busy")
        drafter, pace = self._drafter(seq)  # what it refuses, it refuses before taking a slot
        limit = len(seq.ids) - 1  # at least one prompt token is evaluated, for its logits
        shared = {s: common_prefix(s.tokens, seq.ids, limit) if s.policy == seq.policy else 0
                  for s in free}  # fmt: skip
        slot = max(free, key=lambda s: (shared[s], not s.tokens, -s.sid))
        reuse = shared[slot]
        hit = seq.prefix
        if hit is not None and hit.n > reuse:  # the prefix cache has more: the emptiest slot takes it
            slot = min(free, key=lambda s: (len(s.tokens), s.sid))
            reuse = 0
        else:
            seq.prefix = hit = None
        if slot.policy != seq.policy or (slot.caches and slot.caches[0].dropped):
            slot.caches, slot.tokens = [], []  # made for another policy, or it forgot tokens
            reuse = 0
        if not slot.caches:
            slot.caches, slot.policy = self.new_caches(seq.policy, slot.sid), seq.policy
        if hit is not None:
            self._restore(slot, hit.pieces)
            slot.tokens = list(seq.ids[: hit.n])
            reuse = hit.n
        if not all(c.exact(c.offset - reuse) for c in slot.caches):
            reuse = 0  # the cache cannot give back exactly that prefix (a KIVI group's originals)
        for c in slot.caches:
            c.trim(c.offset - reuse)
        del slot.tokens[reuse:]
        slot.seq, slot.fed, slot.last = seq, reuse, None
        slot.history = list(seq.ids)
        slot.sampler = make_sampler(seq.sampling, self.device)
        slot.drafter, slot.pace = drafter, pace
        seq.state = slot
        return reuse

    # -- the prefix cache (`localllm.prefix_cache`): blocks of plain caches ----------------------

    prefix_kind = "edge"

    @property
    def prefix_budget(self) -> int:
        """Bytes the engine's prefix cache may hold: as much as the slots' caches hold when full,
        at most 512 MiB; 0 (none) for caches that are not plain float buffers (quantized codes,
        H2O eviction), whose positions cannot be cut out and put back exactly."""
        if self.budget or self.kv_types[0] != self.kv_types[1] or self.kv_types[0] not in _KV_DTYPES:
            return 0
        caches = self.new_caches()
        per_token = sum(c.bytes_per_token() for c in caches)
        return int(min(512 * 2**20, per_token * self.n_ctx * self.n_slots))

    def prefix_tokens(self, seq: Seq) -> list[int]:
        """The tokens a finishing sequence's caches hold exactly (none after a context shift)."""
        slot = seq.state
        if not isinstance(slot, _Slot) or not slot.caches or slot.policy.enabled:
            return []
        if slot.caches[0].dropped or not all(isinstance(c, KVCache) for c in slot.caches):
            return []
        return list(slot.tokens[: slot.n_past])

    @on_compute_thread
    @torch.inference_mode()
    def prefix_save(self, seq: Seq, start: int, end: int) -> _Block:
        slot = seq.state
        return _Block([(c.k[:, :, start:end].clone(), c.v[:, :, start:end].clone()) for c in slot.caches])

    @staticmethod
    def prefix_split(block: _Block, k: int) -> tuple[_Block, _Block]:
        return (_Block([(a[:, :, :k], b[:, :, :k]) for a, b in block.kv]),
                _Block([(a[:, :, k:], b[:, :, k:]) for a, b in block.kv]))  # fmt: skip

    @on_compute_thread
    @torch.inference_mode()
    def _restore(self, slot: _Slot, pieces: Sequence[tuple[_Block, int]]) -> None:
        for c in slot.caches:
            c.trim(c.offset)
        for block, n in pieces:
            for c, (k, v) in zip(slot.caches, block.kv):
                c.update_and_fetch(k[:, :, :n], v[:, :, :n])

    def release(self, seq: Seq, keep: bool = True) -> None:
        slot = seq.state
        if not isinstance(slot, _Slot) or slot.seq is not seq:
            return
        seq.state = None
        slot.seq = slot.last = slot.sampler = slot.drafter = slot.pace = None
        slot.history, slot.shifted = [], []
        if not keep:
            slot.caches, slot.tokens, slot.draft = [], [], None

    def kv_bytes(self) -> int:
        """Bytes every slot's caches hold now (codes, scales, residuals, free room; the shared
        rows once, with the room of slots not in use)."""
        shared = sum(r.nbytes for r in self._rows or ())
        return shared + sum(c.nbytes for slot in list(self._slots) for c in list(slot.caches)
                            if getattr(c, "rows", None) is None)  # fmt: skip

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads, as this engine holds them (fp16 packed by
        fbgemm, int4 codes with their scales, f32 ...): every module's own tensors once, but
        not an embedding table, of which a step reads one row — unless the head shares it."""
        from localllm.backends.torch.quantized import Fp16Linear

        seen: set[int] = set()
        total = 0
        for m in self.model.modules():
            if isinstance(m, torch.nn.Embedding):
                continue
            if isinstance(m, Fp16Linear) and m._packed is not None:  # fbgemm's copy: 2 bytes each
                total += 2 * m.out_features * m.in_features
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    def drop_caches(self) -> None:
        """Forget what every free slot's cache holds (and free its memory: the shared rows
        once no slot is in use)."""
        for slot in self._slots:
            if slot.seq is None:
                slot.caches, slot.tokens, slot.draft = [], [], None
        if all(slot.seq is None for slot in self._slots):
            self._rows = None

    # -- one step ------------------------------------------------------------------------------

    @on_compute_thread
    @torch.inference_mode()
    def step(self, plan: Mapping[Seq, int]) -> dict[Seq, list[Step]]:
        """Prefill chunks one sequence at a time (pieces of `max_batch`), then every decoding
        sequence in one (B, 1) forward. A decoding sequence whose context is full gets no Step."""
        out: dict[Seq, list[Step]] = {}
        decoding: list[_Slot] = []
        speculating: list[_Slot] = []
        for seq, n in plan.items():
            slot = seq.state
            if not isinstance(slot, _Slot) or slot.seq is not seq:
                raise LocalLLMError("a sequence was stepped that holds no torch slot")
            if slot.last is None:  # prefilling
                left = len(seq.ids) - slot.fed
                tokens = seq.ids[slot.fed : slot.fed + (min(n, left) if n > 0 else left)]
                if not seq.policy.enabled and slot.n_past + len(tokens) > self.n_ctx:
                    raise ContextOverflow(
                        f"{slot.n_past + len(tokens)} tokens do not fit the context of {self.n_ctx}"
                    )
                h = None
                size = self._chunk(seq.policy)
                for i in range(0, len(tokens), size):
                    h = self._forward([slot], [tokens[i : i + size]])
                slot.fed += len(tokens)
                if slot.fed == len(seq.ids) and h is not None:
                    out[seq] = [self._sample(slot, self.model.logits(h[0, -1]))]
            elif not seq.policy.enabled and slot.n_past + 1 > self.n_ctx:
                out[seq] = []  # the context is full
            elif slot.pace is not None and slot.pace.on:
                speculating.append(slot)
            else:
                decoding.append(slot)
        if decoding:
            h = self._forward(decoding, [[s.last] for s in decoding])  # type: ignore[list-item]
            logits = self.model.logits(h[:, -1])  # (B, V)
            for row, slot in enumerate(decoding):
                step = self._sample(slot, logits[row])
                out[slot.seq] = [replace(step, passes=1)]  # type: ignore[index]
        for slot in speculating:  # one at a time: each verifies its own number of drafts
            out[slot.seq] = self._speculate(slot)  # type: ignore[index]
        return out

    def _forward(self, slots: Sequence[_Slot], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Evaluate equally long token lists, one per slot, at each slot's next positions.
        On failure every cache is trimmed back, so each slot holds what it held before."""
        before = [s.n_past for s in slots]
        dropped = [s.caches[0].dropped for s in slots]
        x = torch.tensor(tokens, dtype=torch.long, device=self.device)  # (B, T)
        try:
            h = self.model(x, [s.caches for s in slots])  # (B, T, dim)
        except Exception as e:
            for s, n, d in zip(slots, before, dropped):
                if s.caches[0].dropped != d:  # what was forgotten is gone: start afresh
                    s.caches, s.tokens = [], []
                    continue
                for c in s.caches:
                    c.trim(c.offset - n)
            if isinstance(e, torch.OutOfMemoryError):
                raise LocalLLMError(
                    f"the torch engine ran out of memory on {self.device.type} evaluating "
                    f"{x.numel()} tokens; try a smaller --ctx or --parallel"
                ) from None
            raise
        for s, t, d in zip(slots, tokens, dropped):
            s.tokens.extend(t)
            if s.caches[0].dropped != d:  # forgotten tokens: reported with the next token
                s.shifted.append(s.caches[0].dropped - d)
        return h

    def _sample(self, slot: _Slot, logits: torch.Tensor) -> Step:
        seq = slot.seq
        assert seq is not None and slot.sampler is not None
        logits = logits.float()
        if seq.constraint is not None:
            logits = seq.constraint.mask_torch(logits)
        token = slot.sampler(logits, slot.history)
        if seq.constraint is not None:
            seq.constraint.consume(token)
        lp, top = None, ()
        if seq.sampling.logprobs is not None:
            lp, top = logprobs(logits, token, seq.sampling.logprobs)
        slot.last = token
        slot.history.append(token)
        step = Step(token, shifted=tuple(slot.shifted), logprob=lp, top=top)
        slot.shifted = []
        return step

    # -- the rest ------------------------------------------------------------------------------

    @on_compute_thread
    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalised final hidden states (as the llama.cpp backend's)."""
        vectors = []
        with self._lock:
            for t in texts:
                ids = self.tokenize(t)
                if len(ids) > self.n_ctx:
                    raise ContextOverflow(
                        f"an input has {len(ids)} tokens but the context holds {self.n_ctx}"
                    )
                if not ids:
                    raise LocalLLMError("cannot embed an empty input")
                caches = self.model.make_caches(len(ids), dtype=self.kv_dtype, device=self.device)
                total = None
                for i in range(0, len(ids), self.max_batch):
                    x = torch.tensor([ids[i : i + self.max_batch]], device=self.device)
                    s = self.model(x, [caches])[0].float().sum(0)
                    total = s if total is None else total + s
                v = torch.nn.functional.normalize(total / len(ids), dim=-1)  # type: ignore[operator]
                vectors.append([float(x) for x in v.tolist()])
        return vectors

    def close(self) -> None:
        for slot in self._slots:
            slot.caches, slot.tokens, slot.seq = [], [], None
        self.model = None  # type: ignore[assignment]


class TorchScorer:
    """Feeds a text through one sequence's caches and returns the logits after every token.

    `token_by_token`: whether `feed` must get one token at a time to evaluate as generation does.
    Whole chunks are the same computation only when every key and value reads back as it was
    written, whichever query reads it: a plain float cache, or int8 / fp8 (each token quantized on
    its own, before any query reads it). KIVI's residual quantizes a group once later tokens
    arrive, and StreamingLLM and H2O forget between tokens: one at a time there.
    """

    def __init__(self, backend: TorchBackend, policy: ContextPolicy) -> None:
        self.backend = backend
        self.caches = backend.new_caches(policy)
        self.token_by_token = bool(policy.enabled or backend.budget
                                   or {"int4", "int2"} & set(backend.kv_types))  # fmt: skip
        self.chunk = 1 if self.token_by_token else backend.max_batch
        self.peak_bytes = 0
        self.step_bytes = 0  # the largest full-precision copy attention read in one layer

    @on_compute_thread
    @torch.inference_mode()
    def feed(self, tokens: Sequence[int]) -> Any:
        """numpy float32 (len(tokens), vocab): the logits after each of `tokens`."""
        b = self.backend
        x = torch.tensor([list(tokens)], dtype=torch.long, device=b.device)
        h = b.model(x, [self.caches])
        logits = b.model.logits(h[0]).float().cpu().numpy()
        self.peak_bytes = max(self.peak_bytes, sum(c.nbytes for c in self.caches))
        # a quantized cache is read back as a full-precision copy of one layer's keys and values
        # at a time (a plain one in place, in its own type: `models.base.attend`)
        first = self.caches[0]
        if not isinstance(first, KVCache):
            a = b.model.args
            elem = torch.empty(0, dtype=b.compute_dtype).element_size()
            copy = first.held * 2 * a.n_kv_heads * a.head_dim * elem
            self.step_bytes = max(self.step_bytes, copy)
        return logits

    def kv_stats(self) -> dict[str, float]:
        return {
            "kv_bytes_per_token": sum(c.bytes_per_token() for c in self.caches),
            "kv_residual_bytes": sum(c.residual_bytes for c in self.caches),
            "kv_peak_bytes": self.peak_bytes,
            "kv_step_bytes": self.step_bytes,
        }


def check_speculative(spec: str | None, *, policy: ContextPolicy, budget: int = 0,
                      draft_name: str | None = "") -> None:  # fmt: skip
    """What speculation cannot compose with (`LocalLLMError`, one line each). `draft_name`: the
    loaded draft model's (None: none loaded; "": not known yet, before loading)."""
    mode = speculative_mode(spec)
    if mode == "off":
        return
    if budget:
        raise LocalLLMError(
            "speculative decoding cannot run with H2O eviction (--evict): verifying drafts adds "
            "their attention to the heavy-hitter scores and can evict tokens, which a "
            "rollback cannot undo"
        )
    if policy.enabled:
        raise LocalLLMError(
            "speculative decoding cannot run with --streaming: verifying k drafts at once "
            "makes the window forget k tokens early, which a rollback cannot bring back"
        )
    if mode == "draft" and draft_name != "" and spec != f"draft:{draft_name}":
        raise LocalLLMError(
            f"--speculative {spec}: this model was loaded "
            + (f"with the draft model {draft_name}" if draft_name else "without a draft model")
            + "; load it with that --speculative to use another"
        )


def open_backend(path: str | Path, options: Any, *, name: str, digest: str,
                 home: Path | None = None) -> TorchBackend:  # fmt: skip
    """The registry's factory."""
    del name  # the torch engine runs in this process: no first-load child
    from localllm.models_registry.store import Store

    check_speculative(options.speculative, policy=options.context,
                      budget=int((options.evict or ":0").partition(":")[2]))  # fmt: skip
    store = Store(home)
    draft = None
    if speculative_mode(options.speculative) == "draft":
        from localllm.models_registry.catalog import ensure_local

        given = options.speculative.partition(":")[2]
        draft = (given, store.path_of(ensure_local(given, store)))
    return TorchBackend(path, n_ctx=options.ctx, n_slots=options.parallel, device=options.device,
                        dtype=options.dtype, kv_cache=options.kv_cache, evict=options.evict,
                        threads=options.threads or _default_threads(),
                        speculative=options.speculative, draft=draft,
                        tuned=store.home / "tuned" / f"{digest[:16]}.json")  # fmt: skip


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)
