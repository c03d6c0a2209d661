"""The torch runner (`localllm.backends.base.Runner`): a GGUF model on one torch device, its
tokenizer, and one set of per-layer caches per slot. The engine decides what runs; this evaluates.

A slot's caches are one cache per layer in its blocks of that layer's `cache.Rows` (a paged pool:
a slot holds the 64-position blocks its positions fill): a plain one (`cache.KVCache`: floats,
int8/fp8 codes, KIVI's int4/int2 with their residual), StreamingLLM's or H2O's
(`policies.PagedStreaming`, `policies.PagedH2O`); only StreamingLLM over KIVI's codes and a mix
of KIVI's and other types keep buffers of their own (`policies`). A
forward pass evaluates each multi-token piece on its own, in chunks (peak memory does not grow
with the prompt), then every one-token piece together as one (B, 1) batch that attends over the
shared rows (`models.base.attend`), each row getting the bits it gets alone. The prefix cache
(`localllm.prefix_cache`) keeps `cache.Prefix` handles: the pool's blocks that hold a run of
positions, shared with the slots that restore them (copy-on-write), never copied out.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localllm.backends import TORCH
from localllm.backends.base import Forward, Piece, TextOnly
from localllm.backends.torch.cache import BLOCK, KVCache, Pages, Prefix, Rows
from localllm.backends.torch.compiled import CompiledStep, cache_dir, prepare, wanted
from localllm.backends.torch.draft_head import HeadState, softcap
from localllm.backends.torch.kvquant import GROUPED, POOLED, RESIDUAL, codec, pooled
from localllm.backends.torch.models.base import QUERIES_AS_ROWS, Tree
from localllm.backends.torch.policies import PagedStreaming
from localllm.chat import template_for
from localllm.errors import ContextOverflow, LocalLLMError, OutOfBlocks
from localllm.memory import parse_kv_cache
from localllm.types import ContextPolicy

__all__ = ["TorchRunner", "on_compute_thread", "open_runner", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)
_KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# The CPU's default working precision: the fastest path measured here that keeps KL ≤ 0.01 nats
# and top-1 ≥ 99% against f32 (bench/torch_gemv.py, bench/torch_engine.py; numbers in the issue
# 11 note): the file's 4-bit feed-forward matrices kept 4-bit in torch's int4 matmul
# (`quantized.Int4Linear`), every other projection fp16 in fbgemm's GEMM (`quantized.Fp16Linear`).
CPU_DEFAULT_DTYPE = "int4"


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
    (auto: bf16 on CUDA, and on MPS from macOS 14, f16 on older MPS), and int4 is bf16 with
    every quantized matrix of the file kept coded, 4-bit ones 4-bit and the rest int8
    (`models.base.device_linear`). On the CPU, f16 means
    fp16 *weights* with f32 compute (`quantized.Fp16Linear`), int4 (the default there) the same
    with the file's 4-bit feed-forward matrices kept 4-bit (`quantized.Int4Linear`; where torch
    lacks the kernel they are fp16 too), and bf16 is bf16 throughout (fast only where the CPU
    has native bf16 dot products).
    """
    if name == "auto":  # on Metal bf16 where macOS has it (f16 overflows in Gemma 3's activations)
        mps = "bf16" if device.type == "mps" and torch.backends.mps.is_macos_or_newer(14, 0) else "f16"
        name = {"cuda": "bf16", "mps": mps}.get(device.type, CPU_DEFAULT_DTYPE)
    if name == "int4":  # the file's 4-bit matrices stay 4-bit; on a GPU the rest is bf16
        if device.type == "cpu":
            return name, torch.float32
        if device.type == "mps" and not torch.backends.mps.is_macos_or_newer(14, 0):
            raise LocalLLMError("int4 on Apple Metal computes in bf16, which needs macOS 14; use "
                                "--dtype f16")  # fmt: skip
        return name, torch.bfloat16
    if name not in _KV_DTYPES:
        raise LocalLLMError(f"the torch engine has no {name} working precision "
                            "(f32, bf16, f16, int4)")  # fmt: skip
    if name == "bf16" and device.type == "mps" and not torch.backends.mps.is_macos_or_newer(14, 0):
        raise LocalLLMError("bf16 on Apple Metal needs macOS 14; use --dtype f16")
    if name == "f16" and device.type == "cpu":
        return name, torch.float32
    return name, _KV_DTYPES[name]


def check_kv_types(kv_types: tuple[str, str], device: torch.device) -> tuple[str, str]:
    """The cache's (key, value) types where this device can hold them; else one line."""
    from localllm.backends.torch.kvquant import CODECS

    for t in kv_types:
        if t not in CODECS:
            raise LocalLLMError(f"the torch backend has no {t} KV cache (it has {', '.join(CODECS)})")
    if "fp8" in kv_types and device.type == "mps":
        raise LocalLLMError("Apple Metal has no float8 in torch: use --kv-cache int8 (as small, "
                            "one scale per token and head)")  # fmt: skip
    return kv_types


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (Metal)"
    # the same file may move between CPUs (AVX2, AVX-512 ...): tuned results are kept per kind
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


# -- one thread for torch's work ----------------------------------------------------------------
# OpenMP gives every thread that starts parallel work its own team of workers. Loading on the
# caller's thread and decoding on the engine's scheduler thread made two teams contend for the
# cores: SmolLM2 decoded at 21.5 ms/token on the scheduler thread against 14.3 on the loading
# thread (2 threads, 2 cores). So every runner's loading, forwards and embeddings run on this one
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


class TorchRunner(TextOnly):
    """A model file on one torch device: tokenizer, stateless model, one cache set per slot."""

    name = "torch"
    capabilities = TORCH
    prefix_kind = "edge"
    logits_on_device = True  # the engine samples them there: a decode step moves token ids

    @on_compute_thread  # loading is torch work too
    def __init__(self, path: str | Path, *, n_ctx: int, n_slots: int = 1, max_batch: int = 256,
                 device: str = "auto", dtype: str = "auto", kv_cache: str = "f16",
                 evict: str | None = None, threads: int | None = None,
                 kv_blocks: int | None = None, compile: str = "auto",
                 compiled_dir: Path | None = None) -> None:  # fmt: skip
        """Args:
        n_ctx: positions per slot.
        n_slots: caches held at once.
        max_batch: tokens one model call evaluates (a piece's chunk: bounds peak memory).
        device, dtype: see `resolve_device`, `resolve_dtype`.
        kv_cache: the cache's types, `TYPE` or `k=TYPE,v=TYPE` (f16, bf16, f32, or int8, fp8,
            int4, int2 codes: `kvquant`); attention computes in the working dtype.
        evict: `h2o:BUDGET` (`policies.PagedH2O`) or None. StreamingLLM is per slot (`clear`).
        threads: torch's CPU threads (None: as torch has them).
        kv_blocks: blocks of 64 positions the slots' paged pool may hold (None: every slot full
            and the prefix cache's budget; fewer, and a request waits for blocks to come free).
        compile: `auto` (on CUDA), `on` or `off`: decode steps and verifications of paged
            caches (plain, codes, KIVI's, StreamingLLM; not H2O's) run as one compiled call
            (`compiled.CompiledStep`; the pool is then allocated whole); everything else, and
            `off`, runs eagerly.
        compiled_dir: where compiled steps are kept whole for the next start (CPU; None: not kept).
        """
        if threads:
            torch.set_num_threads(threads)
        self.torch_device = resolve_device(device)
        self.device = str(self.torch_device)
        self.device_name = _device_name(self.torch_device)
        self.dtype, self.compute_dtype = resolve_dtype(dtype, self.torch_device)
        self.n_threads = torch.get_num_threads()
        self.kv_types = check_kv_types(parse_kv_cache(kv_cache), self.torch_device)
        self.budget = int(evict.partition(":")[2]) if evict else 0
        if evict and not evict.startswith("h2o:"):
            raise LocalLLMError(
                f"the torch backend has no {evict.partition(':')[0]} eviction (it has h2o)"
            )
        # a plain cache of one float type is the fast path; the throwaway caches of embed() keep
        # that type, or the working dtype when the cache quantizes
        k = self.kv_types[0]
        self.kv_dtype = (
            _KV_DTYPES[k] if k == self.kv_types[1] and k in _KV_DTYPES else self.compute_dtype
        )
        linear = None
        if self.dtype in ("f16", "int4") and self.torch_device.type == "cpu":
            from localllm.backends.torch.quantized import Fp16Linear, quantize_linear

            linear = quantize_linear if self.dtype == "int4" else Fp16Linear.from_float
        elif self.dtype == "int4":
            from localllm.backends.torch.models.base import device_linear

            linear = device_linear(self.torch_device, self.compute_dtype)
        self.model_path = str(path)
        self._linear = linear
        self.compiled = wanted(compile, self.torch_device)
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
        self.n_layers = int(args.n_layers)
        self.n_ctx = max(16, min(int(n_ctx), int(args.context_length or n_ctx)))
        self.n_slots = max(1, int(n_slots))
        self.max_batch = max(1, int(max_batch))
        self.n_vocab = int(self.tokenizer.n_vocab)
        # Whole chunks score as generation evaluates only where every key and value reads back
        # as written, whichever query reads it: not KIVI's int4/int2 residual (a group quantizes
        # once later tokens arrive), nor H2O (it forgets between tokens). StreamingLLM is per
        # slot: the engine feeds one token at a time under it.
        token_by_token = bool(self.budget or {"int4", "int2"} & set(self.kv_types))
        self.scoring_chunk = 1 if token_by_token else self.max_batch
        self._caches: list[list[Any]] = [[] for _ in range(self.n_slots)]
        self._policies = [ContextPolicy() for _ in range(self.n_slots)]
        self._peak = [0] * self.n_slots  # the most bytes a slot's caches held since `clear`
        self._step = [0] * self.n_slots  # the largest float copy attention read in one layer
        self._rows: list[Rows] | None = None  # every slot's plain caches, per layer (`new_caches`)
        self.kv_blocks = kv_blocks
        self._compiled: CompiledStep | None = None  # made on the first compiled step
        self.compiled_dir = compiled_dir
        self._lock = threading.Lock()  # embed() may come from another thread than the engine's
        # the compiler's imports and checks, while the caller idles (`compiled.prepare`)
        self._prepared = prepare(self.torch_device) if self.compiled else None
        self._head: Any = None  # a draft head (`use_head`), its rows of the output head, softcap
        self._head_rows: torch.Tensor | None = None
        self._taps: tuple[int, ...] = ()  # the layers whose inputs are the head's features
        self._head_cap = 0.0
        self._heads = [HeadState() for _ in range(self.n_slots)]

    def _load(self, path: str | Path) -> tuple[Any, Any, dict[str, Any]]:
        """(tokenizer, model, metadata) of a GGUF file in this runner's precision and device."""
        from localllm.backends.torch.models import build_model
        from localllm.backends.torch.models.base import keep_rows_apart
        from localllm.backends.torch.tokenizer import GGUFTokenizer
        from localllm.gguf_file import GGUFFile

        linear = self._linear
        with GGUFFile(path) as f:
            tokenizer = GGUFTokenizer.from_gguf(f)
            model = build_model(
                f, dtype=self.compute_dtype, device=self.torch_device, linear=linear
            )
            if linear is not None and self.torch_device.type == "cpu":
                # the head has its own fp16 copy: lookups read the file's rows
                from localllm.backends.torch.quantized import BlockEmbedding

                model.tok_embeddings = BlockEmbedding.from_gguf(f, "token_embd.weight",
                                                                self.compute_dtype)  # fmt: skip
            meta = dict(f.metadata)
        if self.torch_device.type == "cpu":
            keep_rows_apart(model)  # a decode row's bits must not depend on the rows beside it
        model.eval()
        return tokenizer, model, meta

    # -- tokens --------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def is_end(self, token: int) -> bool:
        return self.tokenizer.is_end(token)

    def bos_text(self) -> str:
        return self.chat_template.bos_token

    # -- caches --------------------------------------------------------------------------------

    def new_caches(self, policy: ContextPolicy | None = None, slot: int | None = None) -> list[Any]:
        """One sequence's caches for `policy` (StreamingLLM) and this runner's types and H2O
        budget (`policies.make_caches`); plain ones for a `slot` are its row of the shared
        `cache.Rows`, others (the prefix budget's, a test's) have buffers of their own."""
        from localllm.backends.torch.policies import make_caches

        rows = None
        if slot is not None:
            if self._rows is None:  # one page set for the layers of each window (0: none)
                a = self.model.args
                windows = [getattr(layer.attention, "window", 0) for layer in self.model.layers]
                limit = self._pool_blocks()
                grouped = all(t in GROUPED for t in self.kv_types)  # KIVI's: a float residual
                books = {w: Pages(self.n_slots, self.n_ctx, limit, window=w,
                                  residual=RESIDUAL if grouped else 0) for w in set(windows)}  # fmt: skip
                codecs = (tuple(codec(t, key=key) for t, key in zip(self.kv_types, (True, False)))
                          if pooled(self.kv_types) else None)  # fmt: skip
                self._rows = [Rows(self.n_slots, a.n_kv_heads, a.head_dim, self.n_ctx,
                                   dtype=self.compute_dtype, device=self.torch_device,
                                   pages=books[w], static=self.compiled, codecs=codecs)
                              for w in windows]  # fmt: skip
            rows = self._rows
        return make_caches(self.model, self.n_ctx, kv_types=self.kv_types, policy=policy,
                           budget=self.budget, dtype=self.compute_dtype, device=self.torch_device,
                           rows=rows, slot=slot or 0)  # fmt: skip

    def _pool_blocks(self) -> int:
        """Blocks the pool may grow to: `kv_blocks`, or as many as every slot full and a prefix
        cache at its budget hold (then only a prefix entry in use past its budget waits)."""
        if self.kv_blocks:
            return self.kv_blocks + 1  # and the zero block
        block = int(BLOCK * sum(c.bytes_per_token() for c in self.new_caches()))  # every layer's
        # a StreamingLLM slot's sinks and window may each end in a block of their own
        return self.n_slots * (-(-self.n_ctx // BLOCK) + 2) + -(-self.prefix_budget // block) + 1

    def _slot(self, slot: int) -> list[Any]:
        """The slot's caches, made for its policy on first use."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range (the runner has {self.n_slots})")
        if not self._caches[slot]:
            self._caches[slot] = self.new_caches(self._policies[slot], slot)
        return self._caches[slot]

    @property
    def _pages(self) -> list[Pages]:
        """The pool's page sets (one per window), each once."""
        return list({id(r.pages): r.pages for r in self._rows or ()}.values())

    def _paged(self, slot: int) -> bool:
        caches = self._caches[slot]
        return bool(caches) and getattr(caches[0], "rows", None) is not None

    def _forget(self, slot: int) -> None:
        """Drop the slot's caches, its blocks back to the pool (and the pool once no slot or
        prefix-cache span holds blocks of it)."""
        if self._paged(slot):
            for pages in self._pages:
                pages.release(slot)
        self._caches[slot] = []
        self._peak[slot] = self._step[slot] = 0
        self._heads[slot].reset()
        self._drop_unused_pool()

    def _drop_unused_pool(self) -> None:
        """Free the pool once no slot's caches are in it and no span holds a block of it."""
        if self._rows and self._rows[0].static:  # allocated whole, once: a compiled step reads it
            return
        if not any(p.used for p in self._pages) and not any(map(self._paged, range(self.n_slots))):
            self._rows = None

    def held(self, slot: int) -> int:
        caches = self._caches[slot]
        return caches[0].offset if caches else 0

    @on_compute_thread
    def clear(self, slot: int, policy: ContextPolicy | None = None) -> None:
        """Empty the slot; its next tokens follow `policy` (caches made for it on first use)."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range (the runner has {self.n_slots})")
        policy = policy or ContextPolicy()
        if policy.enabled and self.n_ctx - (policy.sinks or 0) < 1:
            raise LocalLLMError(f"--streaming keeps {policy.sinks} sink tokens but the context "
                                f"holds {self.n_ctx}; use a larger --ctx")  # fmt: skip
        self._policies[slot] = policy
        self._forget(slot)

    @on_compute_thread
    @torch.inference_mode()
    def trim(self, slot: int, n: int, *, exact: bool = False,
             skip: frozenset[int] = frozenset()) -> bool:  # fmt: skip
        """Forget the slot's last n positions in every layer's cache but those in `skip` (what
        a layer-skip draft wrote). `exact`: only if what stays is exactly what was evaluated
        (not where a quantized group or a context shift changed it); else the slot is cleared
        and False returned."""
        caches = [c for i, c in enumerate(self._caches[slot]) if i not in skip]
        if n <= 0 or not caches:
            return True
        if exact and not all(c.exact(n) for c in caches):
            self._forget(slot)
            return False
        for c in caches:
            c.trim(n)
        if self._paged(slot):  # blocks past every layer's positions go back to the pool
            for pages in self._pages:
                pages.shrink(slot, max(c.at for c in self._caches[slot]))
        if not skip:
            self._heads[slot].trim(self.held(slot))
        return True

    def kv_bytes(self) -> int:
        """Bytes every slot's caches hold now (codes, scales, residuals, free room; the shared
        rows once, with the room of slots not in use)."""
        shared = sum(r.nbytes for r in self._rows or ())
        return shared + sum(c.nbytes for caches in list(self._caches) for c in list(caches)
                            if getattr(c, "rows", None) is None)  # fmt: skip

    def kv_stats(self, slot: int) -> dict[str, float]:
        """What the slot's caches cost: bytes per token, full-precision residual bytes, the
        most bytes they held during forwards since `clear`, and the largest full-precision copy
        attention read in one layer (a quantized cache is read back one layer at a time; a
        plain one in place)."""
        caches = self._caches[slot] or self.new_caches(self._policies[slot])
        return {
            "kv_bytes_per_token": sum(c.bytes_per_token() for c in caches),
            "kv_residual_bytes": sum(c.residual_bytes for c in caches),
            "kv_peak_bytes": self._peak[slot],
            "kv_step_bytes": self._step[slot],
        }

    def _note(self, slot: int) -> None:
        caches = self._caches[slot]
        self._peak[slot] = max(self._peak[slot], sum(c.nbytes for c in caches))
        first = caches[0]
        if not isinstance(first, KVCache):
            a = self.model.args
            elem = torch.empty(0, dtype=self.compute_dtype).element_size()
            self._step[slot] = max(
                self._step[slot], first.held * 2 * a.n_kv_heads * a.head_dim * elem
            )

    def _chunk(self, policy: ContextPolicy) -> int:
        """Tokens one model call evaluates of a piece: under a policy that forgets, at most half
        of what it keeps, so every new token still sees most of its window."""
        keep = (
            min(policy.window, self.n_ctx - (policy.sinks or 0)) if policy.enabled else self.budget
        )
        return max(1, min(self.max_batch, keep // 2)) if keep else self.max_batch

    # -- the forward pass ----------------------------------------------------------------------

    @on_compute_thread
    def use_head(self, path: Path, digest: str) -> None:
        """Draft with the head kept at `path` (`train_draft.load_head`: one line if it is not a
        head of this model): from now on every slot's evaluated positions leave their features
        for it (`head_logits`). Compiled steps give no features: with a head, forwards run
        eagerly."""
        from localllm.backends.torch.train_draft import head_rows, load_head

        if self._head is not None:
            return
        head = load_head(path, digest)
        taps = getattr(head, "taps", ())  # EAGLE-3: the hidden states going into these layers
        if any(not 0 <= t < self.n_layers for t in taps):
            raise LocalLLMError(f"{path.name}: a head reading layers {list(taps)} of a model of "
                                f"{self.n_layers}")  # fmt: skip
        # its own output rows (EAGLE-3), or the target's rows of its vocabulary
        rows = torch.zeros(0, self.model.args.dim) if taps else head_rows(self.model, head.vocab)
        self._taps = tuple(taps)
        self._head = head.to(device=self.torch_device, dtype=self.compute_dtype)
        self._head_rows = rows.to(device=self.torch_device, dtype=self.compute_dtype)
        self._head_cap = softcap(self.model)
        self._head_ids = head.vocab.numpy()  # draft row → token
        self._head_keep = self._head_ids < self.n_vocab  # rows of padding tokens the file may have
        self.head_info = dict(head.meta)  # type: ignore[attr-defined]

    @on_compute_thread
    def head_logits(self, slot: int, token: int) -> np.ndarray | None:
        """The draft head's logits (n_vocab,) float32 of the token after `token` (-inf outside
        its draft vocabulary): the slot's last sampled token on a round's first call, then each
        token drafted after it. None where it has nothing to go on (`draft_head.HeadState`)."""
        assert self._head is not None and self._head_rows is not None, "use_head first"
        got = self._heads[slot].draft(self._head, self.model.embed, self._head_rows, token,
                                      self._head_cap)  # fmt: skip
        if got is None:
            return None
        return self._full_vocab(got[None])[0]

    @on_compute_thread
    def head_expand(self, slot: int, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Draft entries of this round (`Runner.head_expand`, `draft_head.HeadState.expand`):
        their logits (len(tokens), n_vocab), -inf outside the draft vocabulary."""
        assert self._head is not None and self._head_rows is not None, "use_head first"
        got = self._heads[slot].expand(self._head, self.model.embed, self._head_rows, tokens,
                                       parents, self._head_cap)  # fmt: skip
        return self._full_vocab(got)

    def _full_vocab(self, got: torch.Tensor) -> np.ndarray:
        """The head's rows (n, len(vocab)) as logits over the whole vocabulary (n, n_vocab)."""
        out = np.full((len(got), self.n_vocab), -np.inf, dtype=np.float32)
        keep = self._head_keep
        out[:, self._head_ids[keep]] = got.float().cpu().numpy()[:, keep]
        return out

    def tree_tokens(self, slot: int) -> int:
        """Tokens of a draft tree the slot verifies in one piece (`Piece.parents`; 0: none):
        as many as attend query by query (`QUERIES_AS_ROWS`), over plain caches in the paged
        pool (floats or codes; not KIVI's groups, H2O or StreamingLLM)."""
        if self.budget or self._policies[slot].enabled or not self._plain(slot):
            return 0
        return 0 if self._caches[slot][0].rows.grouped else min(QUERIES_AS_ROWS, self.max_batch)

    @on_compute_thread
    @torch.inference_mode()
    def keep(self, slot: int, start: int, path: Sequence[int]) -> None:
        """After a tree piece at positions start ..: its tokens at `path` (ascending, 0
        first) at start, start + 1 ..., the rest forgotten, in every layer and the head's."""
        t = self.held(slot) - start
        if not path or path[0] != 0 or path[-1] >= t or any(b <= a for a, b in zip(path, path[1:])):
            raise ValueError(f"a path through a tree of {t} tokens must rise from its first: {path}")
        for c in self._caches[slot]:
            c.keep(start, path)
        for pages in self._pages:
            pages.shrink(slot, max(c.at for c in self._caches[slot]))
        self._heads[slot].keep(start, path, t)

    def head_done(self, slot: int) -> None:
        """A round of drafting is over: what it drafted leaves the head's cache."""
        self._heads[slot].done()

    @on_compute_thread
    def train_draft_head(self, text: Sequence[int], out: Path, *, digest: str, **kw: Any) -> Path:
        """Train (or resume) this model's draft head on `text` (`train_draft.train`): the model
        stays frozen; its caches are its own (no slot is touched)."""
        from localllm.backends.torch.train_draft import train

        return train(self.model, text, out, digest=digest, **kw)

    @on_compute_thread
    @torch.inference_mode()
    def forward(self, pieces: Sequence[Piece], *, skip: frozenset[int] = frozenset()) -> Forward:
        """Evaluate every piece at its slot's next positions: multi-token pieces one at a time in
        chunks of `_chunk` tokens, then the one-token pieces together as one (B, 1) batch.
        Returns the logits of each piece's last `logits` tokens, in piece order, on the host.

        `skip`: layers left out (a layer-skip draft): only the others' caches grow. On failure
        every slot holds what it held before (a slot whose cache forgot tokens meanwhile is
        cleared: forgetting is final), and the error is raised."""
        pieces = [Piece(*p) for p in pieces]
        skip = frozenset(skip)
        kept = [i for i in range(self.n_layers) if i not in skip]
        if not kept:
            raise ValueError("a forward pass must keep at least one layer")
        seen: set[int] = set()
        for p in pieces:
            if p.slot in seen:
                raise ValueError(f"two pieces for slot {p.slot} in one forward pass")
            seen.add(p.slot)
            if not p.tokens or not 0 <= p.logits <= len(p.tokens):
                raise ValueError(f"a piece of {len(p.tokens)} tokens cannot give {p.logits} logits")
            if p.on_device and p.logits != 1:
                raise ValueError("a piece whose row stays on the device gives one row of logits")
            if p.parents is not None and (
                len(p.parents) != len(p.tokens) or len(p.tokens) > self.tree_tokens(p.slot) or skip
                or p.logits != len(p.tokens)):  # fmt: skip
                raise ValueError(f"slot {p.slot} cannot verify a tree of {len(p.tokens)} tokens "
                                 f"here (at most {QUERIES_AS_ROWS}, every row's logits, plain "
                                 "caches)")  # fmt: skip
            caches = self._slot(p.slot)
            if not self._policies[p.slot].enabled:
                end = max(caches[i].offset for i in kept) + len(p.tokens)
                if end > self.n_ctx:
                    raise ContextOverflow(f"{end} tokens do not fit the context of {self.n_ctx}")
        before = {p.slot: [c.offset for c in self._caches[p.slot]] for p in pieces}
        places = {s: max(c.at for c in self._caches[s]) for s in before if self._paged(s)}
        dropped = {p.slot: self._caches[p.slot][kept[0]].dropped for p in pieces}
        fresh: list[tuple[int, int, torch.Tensor, list[int]]] | None = (
            [] if self._head is not None and not skip else None
        )
        try:
            rows = self._evaluate(pieces, skip, fresh)
        except Exception as e:
            for slot, offsets in before.items():
                caches = self._caches[slot]
                if caches and (caches[kept[0]].dropped != dropped[slot]
                               or not all(c.exact(c.offset - n) for c, n in zip(caches, offsets))):  # fmt: skip
                    self._forget(slot)  # what was forgotten (or coded) is gone: start afresh
                    continue
                for c, n in zip(caches, offsets):
                    c.trim(c.offset - n)
                if self._paged(slot):  # blocks taken for positions it did not keep go back
                    for pages in self._pages:
                        pages.shrink(slot, places[slot])
            if isinstance(e, torch.OutOfMemoryError):
                tokens = sum(len(p.tokens) for p in pieces)
                raise LocalLLMError(
                    f"the torch engine ran out of memory on {self.torch_device.type} evaluating "
                    f"{tokens} tokens; try a smaller --ctx or --parallel"
                ) from None
            raise
        for slot, pos, h, tokens in fresh or ():  # the draft head's features, once all went well
            self._heads[slot].record(pos, h, tokens)
        shifted = {}
        for slot, d in dropped.items():
            self._note(slot)
            now = self._caches[slot][kept[0]].dropped
            if now != d:
                shifted[slot] = now - d
        wanted = [p for p in pieces if p.logits]  # what `rows` holds, in order
        kept = [r for p, r in zip(wanted, rows) if p.on_device]
        rows = [r for p, r in zip(wanted, rows) if not p.on_device]
        if rows:
            logits = torch.cat(rows).float().cpu().numpy()[:, : self.n_vocab]
        else:
            logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        return Forward(logits, shifted, torch.cat(kept)[:, : self.n_vocab] if kept else None)

    def _evaluate(self, pieces: Sequence[Piece], skip: frozenset[int],
                  fresh: list[tuple[int, int, torch.Tensor, list[int]]] | None = None,
                  ) -> list[torch.Tensor]:  # fmt: skip
        """The model calls of `forward`; the logits rows in piece order. `fresh`: where the
        features of every position evaluated go (slot, first position, (T, dim), tokens)."""
        model, dev = self.model, self.torch_device
        out: dict[int, torch.Tensor] = {}
        singles = []
        compiled = self.compiled and not skip and fresh is None
        for i, p in enumerate(pieces):
            if len(p.tokens) == 1:
                singles.append(i)
                continue
            caches, tokens = self._caches[p.slot], list(p.tokens)
            tree = Tree(p.parents) if p.parents is not None else None  # one chunk (checked)
            if compiled and tree is None and len(tokens) <= QUERIES_AS_ROWS and self._compilable([p.slot]):
                got = self._run_compiled([p.slot], [tokens])  # a verification of a few drafts
                if p.logits:
                    out[i] = got[len(tokens) - p.logits :]
                continue
            size, n, rows = self._chunk(self._policies[p.slot]), len(tokens), []
            for s in range(0, n, size):
                chunk = tokens[s : s + size]
                x = torch.tensor([chunk], dtype=torch.long, device=dev)  # (1, T)
                at = caches[0].offset
                taps = dict.fromkeys(self._taps) if fresh is not None and self._taps else None
                h = model(x, [caches], skip=skip, tree=tree, taps=taps)[0]  # (T, dim)
                if fresh is not None:
                    fresh.append((p.slot, at, self._features(h, taps, 0), chunk))
                first = n - p.logits - s  # the chunk's first position that wants logits
                if first < len(chunk):
                    rows.append(model.logits(h[max(0, first) :]))
            if rows:
                out[i] = rows[0] if len(rows) == 1 else torch.cat(rows)
        slots = [pieces[i].slot for i in singles]
        if singles and compiled and self._compilable(slots):
            logits = self._run_compiled(slots, [[pieces[i].tokens[0]] for i in singles])
            for j, i in enumerate(singles):
                if pieces[i].logits:
                    out[i] = logits[j : j + 1]
        elif singles:
            x = torch.tensor([[pieces[i].tokens[0]] for i in singles], dtype=torch.long, device=dev)
            ats = [self._caches[pieces[i].slot][0].offset for i in singles]
            taps = dict.fromkeys(self._taps) if fresh is not None and self._taps else None
            h = model(x, [self._caches[pieces[i].slot] for i in singles], skip=skip, taps=taps)  # (B, 1, dim)
            if fresh is not None:
                fresh += [(pieces[i].slot, at, self._features(h, taps, j), [pieces[i].tokens[0]])
                          for j, (i, at) in enumerate(zip(singles, ats))]  # fmt: skip
            want = [j for j, i in enumerate(singles) if pieces[i].logits]
            if want:
                idx = torch.tensor(want, device=dev)
                logits = model.logits(h[idx])[:, 0]  # (B', vocab); (B', 1, dim) rows kept apart
                for row, j in enumerate(want):
                    out[singles[j]] = logits[row : row + 1]
        return [out[i] for i in range(len(pieces)) if i in out]

    def _features(self, h: torch.Tensor, taps: dict[int, Any] | None, row: int) -> torch.Tensor:
        """Row `row`'s features for the draft head, (T, width): the model's last hidden states
        (EAGLE-1), or the hidden states going into its `taps` layers side by side (EAGLE-3)."""
        if taps is None:
            return h if h.dim() == 2 else h[row]
        return torch.cat([taps[t][row] for t in self._taps], dim=-1)

    def _plain(self, slot: int) -> bool:
        """Whether the slot's caches are plain ones in the paged pool (floats or codes)."""
        caches = self._slot(slot)
        return isinstance(caches[0], KVCache) and caches[0].rows is not None

    def _compilable(self, slots: Sequence[int]) -> bool:
        """Whether one compiled step takes these slots: plain ones in the paged pool, and
        StreamingLLM ones there whose layers forgot alike (a layer-skip draft moves some
        layers only) and share one RoPE."""
        ropes = set()
        for s in slots:
            if self._plain(s):
                continue
            r = self._slot(s)
            if not isinstance(r[0], PagedStreaming) or len({c.gap for c in r}) != 1:
                return False
            ropes |= {id(c.rope) for c in r}
        return len(ropes) <= 1

    def _run_compiled(self, slots: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """T tokens of each slot (as many each) through the compiled step: logits (B·T, vocab)."""
        if self._compiled is None:
            self._compiled = CompiledStep(self.model, self.torch_device, self.compiled_dir, self._prepared)
        caches = [self._caches[s] for s in slots]
        t, streams = len(tokens[0]), None
        kinds = [isinstance(row[0], PagedStreaming) for row in caches]
        if any(kinds):  # what the eager forward's positions do (a plain cache's is a no-op)
            for row in caches:
                for c in row:
                    c.make_room(t)
            windows = [(row[0].n_sinks, row[0].gap) if k else None for row, k in zip(caches, kinds)]
            streams = (windows, caches[kinds.index(True)][0].rope)
        try:
            logits = self._compiled(self._rows, slots, [c[0].offset for c in caches], tokens,  # type: ignore[arg-type]
                                    places=[c[0].at for c in caches], streams=streams)  # fmt: skip
        except (LocalLLMError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            if self._compiled.calls:  # it ran before: not a compile failure
                raise
            why = (str(e).strip().splitlines() or [""])[0][:200]
            log.warning("the compiled step could not be built (%s: %s); the torch engine runs "
                        "eagerly (--no-compile says so up front)", type(e).__name__, why)  # fmt: skip
            self.compiled = False
            x = torch.tensor(tokens, dtype=torch.long, device=self.torch_device)  # (B, T)
            return self.model.logits(self.model(x, caches)).reshape(x.numel(), -1)
        for row in caches:
            for c in row:
                c.advance(t)
        return logits

    # -- the prefix cache (`localllm.prefix_cache`): blocks of plain caches ----------------------

    @property
    def prefix_budget(self) -> int:
        """Bytes the engine's prefix cache may hold: as much as the slots' caches hold when full,
        at most 512 MiB; 0 (none) for caches the paged pool does not hold (KIVI's grouped codes,
        H2O eviction), whose positions cannot be cut out and put back exactly."""
        if self.budget or not all(t in POOLED for t in self.kv_types):
            return 0
        caches = self.new_caches()
        per_token = sum(c.bytes_per_token() for c in caches)
        return int(min(512 * 2**20, per_token * self.n_ctx * self.n_slots))

    @on_compute_thread
    def save(self, slot: int, start: int, end: int) -> Prefix:
        """A handle on positions [start, end) of the slot: the blocks that hold them, shared."""
        caches = self._caches[slot]
        if not caches or not all(isinstance(c, KVCache) and c.rows is not None
                                 and not c.rows.grouped for c in caches):  # fmt: skip
            raise LocalLLMError("only plain float caches can be saved for the prefix cache")
        if not 0 <= start <= end <= min(c.offset for c in caches):
            raise ValueError(f"positions [{start}, {end}) are not held (the slot holds "
                             f"{caches[0].offset})")  # fmt: skip
        return Prefix([pages.span(slot, start, end) for pages in self._pages],
                      self._heads[slot].entries(start, end))  # fmt: skip

    @on_compute_thread
    def split(self, handle: Prefix, k: int) -> tuple[Prefix, Prefix]:
        """Handles on the first k positions and on the rest (the blocks shared again)."""
        return handle.split(k)

    @on_compute_thread
    def release(self, handle: Prefix) -> None:
        """The prefix cache is done with the handle: its blocks go back unless a slot holds them."""
        handle.release()
        self._drop_unused_pool()

    @on_compute_thread
    @torch.inference_mode()
    def restore(self, slot: int, pieces: Sequence[tuple[Prefix, int]]) -> bool:
        """Make the slot hold the first n positions of each handle in turn, sharing their blocks
        (the slot copies one only when it writes into it); False (the slot left empty) where its
        caches cannot take them (a context policy, quantized types, a stale handle, a window
        that dropped what the next query would see)."""
        caches = self._slot(slot)
        books = self._pages
        if (
            not self._paged(slot)
            or not all(isinstance(c, KVCache) and not c.rows.grouped for c in caches)
            or sum(n for _, n in pieces) > self.n_ctx
            or not all(isinstance(h, Prefix) and not h.released
                       and [sp.pages for sp in h.spans] == books for h, _ in pieces)  # fmt: skip
        ):
            self._forget(slot)
            return False
        try:
            n = 0
            for i, pages in enumerate(books):
                n = pages.assemble(slot, [(h.spans[i], k) for h, k in pieces])
        except (OutOfBlocks, LookupError):  # a block where two spans meet; a window's dropped block
            self._forget(slot)
            return False
        for c in caches:
            c.offset = n
        # the draft head's entries of the restored positions, where the spans kept them
        self._heads[slot].restore([h.head for h, _ in pieces if h.head is not None], n)
        return True

    # -- the rest ------------------------------------------------------------------------------

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads, as this runner holds them (fp16 packed by
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

    @on_compute_thread
    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalised final hidden states (as the llama.cpp runner's)."""
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
                caches = self.model.make_caches(
                    len(ids), dtype=self.kv_dtype, device=self.torch_device
                )
                total = None
                for i in range(0, len(ids), self.max_batch):
                    x = torch.tensor([ids[i : i + self.max_batch]], device=self.torch_device)
                    s = self.model(x, [caches])[0].float().sum(0)
                    total = s if total is None else total + s
                v = torch.nn.functional.normalize(total / len(ids), dim=-1)  # type: ignore[operator]
                vectors.append([float(x) for x in v.tolist()])
        return vectors

    @on_compute_thread
    def close(self) -> None:
        """Free every cache and the model; the runner is unusable after."""
        self._caches = [[] for _ in range(self.n_slots)]
        self._policies = [ContextPolicy() for _ in range(self.n_slots)]
        self._peak, self._step = [0] * self.n_slots, [0] * self.n_slots
        self._rows = None
        self._heads = [HeadState() for _ in range(self.n_slots)]
        self._head = self._head_rows = None
        self._taps = ()
        self.model = None  # type: ignore[assignment]


def open_runner(path: str | Path, options: Any, *, name: str, digest: str,
                home: Path | None = None, projector: Path | None = None) -> TorchRunner:  # fmt: skip
    """The registry's factory (a draft model is a second runner the engine opens). A vision
    projector is not read here: the engine refuses a request with images in one line."""
    del name, digest, projector  # the torch runner runs in this process
    from localllm.backends import torch_too_old

    old = torch_too_old(torch.__version__)
    if old:
        raise LocalLLMError(old)
    saved = cache_dir(home)  # compiled steps kept under the store: a second start reuses them
    return TorchRunner(path, n_ctx=options.ctx, n_slots=options.parallel, device=options.device,
                       dtype=options.dtype, kv_cache=options.kv_cache, evict=options.evict,
                       threads=options.threads or _default_threads(), compile=options.compile,
                       compiled_dir=saved)  # fmt: skip


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)
