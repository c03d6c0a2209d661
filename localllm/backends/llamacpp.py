"""The llama.cpp backend: one llama.cpp context, one sequence per slot, one batch per step.

The model and context are built through llama-cpp-python's low-level API (its `Llama` holds one
sequence): `n_slots` llama.cpp sequences, each with its own `ctx` cells (`kv_unified` off). A step
puts every prompt chunk into one `llama_batch` and every decoding sequence's last sampled token
into the next, and samples each sequence that is due a token with its own sampler chain at its own
row of the batch. Each slot remembers the tokens its cache holds, so a later
prompt sharing that prefix skips it; the StreamingLLM-style context shift works per sequence.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from localllm.backends import LLAMACPP as CAPABILITIES
from localllm.backends import LLAMACPP_KV_TYPES
from localllm.backends.base import Seq, Step, common_prefix
from localllm.chat import template_for
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.memory import parse_kv_cache
from localllm.speculation import Draft, Lookup, Pace
from localllm.types import ContextPolicy, SamplingParams, speculative_mode

_GGML_TYPE = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
assert set(_GGML_TYPE) == set(LLAMACPP_KV_TYPES)


def open_backend(path: str | Path, options: Any, *, name: str, digest: str,
                 home: Path | None = None) -> LlamaCppBackend:  # fmt: skip
    """The registry's factory: the first load of a file runs in a child (a file llama.cpp would
    abort on is refused there), then the model loads here with the options' context and cache."""
    from localllm.backends.llamacpp_guard import check_load

    n_gpu_layers = 0 if options.device == "cpu" else -1
    if speculative_mode(options.speculative) != "off" and options.context.enabled:
        raise LocalLLMError(_NO_SHIFT_SPECULATION)
    check_load(path, digest, name, n_gpu_layers=n_gpu_layers, home=home)
    draft = None
    if speculative_mode(options.speculative) == "draft":
        from localllm.models_registry.catalog import ensure_local
        from localllm.models_registry.store import Store

        store = Store(home)
        given = options.speculative.partition(":")[2]
        record = ensure_local(given, store)
        draft_path = store.path_of(record)
        check_load(draft_path, record.digest, record.name, n_gpu_layers=n_gpu_layers, home=home)
        draft = (given, draft_path)
    return LlamaCppBackend(path, n_ctx=options.ctx, n_slots=options.parallel,
                           kv_cache=options.kv_cache, n_threads=options.threads,
                           n_gpu_layers=n_gpu_layers, speculative=options.speculative,
                           draft=draft)  # fmt: skip


_NO_SHIFT_SPECULATION = ("speculative decoding cannot run with --streaming: verifying k drafts "
                         "at once can make the context shift early, which a rollback cannot undo")  # fmt: skip
LOOKUP_K = 10  # the most tokens prompt lookup proposes in one pass
DRAFT_K = 8  # ... and a draft model


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


# -- llama.cpp's log: into a file in the store, never onto the user's terminal ------------------

LOG_FILE = "logs/llama.cpp.log"
_LOG_MAX = 8 << 20  # rotate to llama.cpp.log.1 past this size
_log_lock = threading.Lock()
_log_state: dict[str, object] = {}
_recent: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=64)  # (seq, level, line)
_LEVELS = {0: "NONE", 1: "DEBUG", 2: "INFO", 3: "WARN", 4: "ERROR"}  # ggml_log_level; 5 = CONT


def log_path() -> Path:
    from localllm.models_registry.store import default_home

    return default_home() / LOG_FILE


def _open_log():  # noqa: ANN202
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > _LOG_MAX:
            os.replace(path, path.with_name(path.name + ".1"))
        return open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError:
        return None  # an unwritable store loses the log, never the answer


def _on_log(level: int, text: bytes, _user: object) -> None:
    line = text.decode("utf-8", "replace") if text else ""
    with _log_lock:
        if level == 5:  # GGML_LOG_LEVEL_CONT: continues the previous line
            level = int(_log_state.get("last", 1))  # type: ignore[arg-type]
        _log_state["last"] = level
        partial = str(_log_state.get("partial", "")) + line
        *done, rest = partial.split("\n")
        _log_state["partial"] = rest
        f = _log_state.get("file")
        home = os.environ.get("LOCALLLM_HOME", "")
        if f is None or _log_state.get("home") != home:
            if f is not None:
                f.close()  # type: ignore[attr-defined]
            f = _log_state["file"] = _open_log()
            _log_state["home"] = home
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for ln in done:
            seq = int(_log_state.get("seq", 0)) + 1  # type: ignore[arg-type]
            _log_state["seq"] = seq
            _recent.append((seq, level, ln))
            if f is not None:
                f.write(f"{stamp} {_LEVELS.get(level, level)} {ln}\n")  # type: ignore[attr-defined]
        if done and f is not None:
            f.flush()  # type: ignore[attr-defined]


def log_mark() -> int:
    """A point in llama.cpp's log, for `recent_errors(since=...)`."""
    with _log_lock:
        return int(_log_state.get("seq", 0))  # type: ignore[arg-type]


def recent_errors(since: int = 0) -> list[str]:
    """llama.cpp's error and warning lines logged after `since` (to quote when a load fails)."""
    with _log_lock:
        lines = list(_recent)
    return [ln.strip() for seq, lvl, ln in lines if seq > since and lvl in (3, 4) and ln.strip()]


def quiet_llama_log():  # noqa: ANN201 - the llama_cpp module
    """Import llama_cpp with its log routed to the store's log file (once per process)."""
    import llama_cpp
    import llama_cpp.llama  # noqa: F401 - installs llama-cpp-python's own logger, which we replace

    with _log_lock:
        if "callback" not in _log_state:
            cb = llama_cpp.llama_log_callback(_on_log)
            _log_state["callback"] = cb  # kept alive: llama.cpp holds only the C pointer
            llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    return llama_cpp


# -- templates: only ours, only in the sandbox -------------------------------------------------


class _TemplateNotCompiled:
    """Stands in for llama-cpp-python's `Jinja2ChatFormatter`.

    `Llama.__init__` builds one for every `tokenizer.chat_template*` key in the file, whatever
    `chat_format` or `chat_handler` it is given, and so compiles a stranger's template with jinja2 in
    our process: a template whose constants jinja2 folds at compile time (`7 ** 999999999`) hangs the load
    before our sandbox ever sees it. We render templates ourselves (`localllm.chat`, in a limited
    child) and never call `create_chat_completion`, so this keeps the text and compiles nothing.
    """

    def __init__(self, template: str, *_args: object, **_kwargs: object) -> None:
        self.template = template

    def to_chat_handler(self):  # noqa: ANN201
        def refuse(*_a: object, **_k: object) -> None:
            raise LocalLLMError("localllm renders chat templates itself (localllm.chat)")

        return refuse


_swap_lock = threading.Lock()


@contextlib.contextmanager
def templates_not_compiled() -> Iterator[None]:
    """While a `Llama` is built, its template formatter is ours (restored afterwards)."""
    import llama_cpp.llama_chat_format as formats

    with _swap_lock:
        original = formats.Jinja2ChatFormatter
        formats.Jinja2ChatFormatter = _TemplateNotCompiled  # type: ignore[misc, assignment]
        try:
            yield
        finally:
            formats.Jinja2ChatFormatter = original  # type: ignore[misc]


def _strip_prefix(line: str) -> str:
    """`llama_model_load: error loading model: X` -> `X` (llama.cpp's function names mean nothing here)."""
    for marker in ("error loading model: ", "error loading model architecture: "):
        if marker in line:
            return line.split(marker, 1)[1]
    head, sep, rest = line.partition(": ")
    return rest if sep and head.replace("_", "").isalnum() and " " not in head else line


_backend_ready = threading.Event()


def _init_backend(lib: Any) -> None:
    """`llama_backend_init` once per process (as `Llama` does)."""
    with _log_lock:
        if not _backend_ready.is_set():
            lib.llama_backend_init()
            _backend_ready.set()


_KEEP_SHARE = 0.75  # a prompt that keeps this much of a slot's cache continues it


class _State:
    """A prefix-cache handle: a sequence's saved cells (positions 0 .. end-1)."""

    def __init__(self, data: bytes, end: int) -> None:
        self.data, self.end = data, end
        self.nbytes = len(data)


@dataclass(eq=False)
class _Slot:
    """One llama.cpp sequence id, what its cache holds and the sequence using it."""

    sid: int
    tokens: list[int] = field(default_factory=list)  # cached, as a fresh evaluation would be
    n_past: int = 0  # cells the sequence holds: the next token's position
    exact: bool = True  # False once shifted: `tokens` then ends at the sinks
    seq: Seq | None = None
    chain: Any = None  # the sequence's sampler chain
    fed: int = 0  # prompt tokens in the cache
    last: int | None = None  # the token sampled last, not yet evaluated
    shifted: list[int] = field(default_factory=list)  # discards not yet reported in a Step
    stamp: int = 0  # when it was last admitted into (least recently used goes first)
    history: list[int] = field(default_factory=list)  # prompt + generated (prompt lookup)
    drafter: Any = None  # speculative decoding: what proposes drafts (None: off)
    pace: Any = None  # its `Pace`


class LlamaCppBackend:
    """A slot backend (`localllm.backends.base.Backend`) over one llama.cpp context."""

    name = "llama.cpp"
    capabilities = CAPABILITIES

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int,
        n_slots: int = 1,
        max_batch: int = 512,
        kv_cache: str = "f16",
        n_threads: int | None = None,
        n_gpu_layers: int = -1,
        flash_attn: bool | None = None,
        speculative: str | None = None,
        draft: tuple[str, str | Path] | None = None,
    ) -> None:
        """Args:
        n_ctx: cells per sequence (llama.cpp rounds it up to a multiple of 256).
        n_slots: sequences held at once, one llama.cpp sequence id each.
        max_batch: tokens one step may evaluate (llama.cpp's n_batch and n_ubatch).
        speculative: the sequences' default mode (off, lookup, draft:MODEL).
        draft: (name, path) of the draft model `draft:NAME` loads: a second llama.cpp context
            with a sequence per slot (same vocabulary, checked).
        """
        llama_cpp = quiet_llama_log()
        from llama_cpp import _internals

        self._lib = llama_cpp
        type_k, type_v = parse_kv_cache(kv_cache)
        for t in (type_k, type_v):
            if t not in _GGML_TYPE:
                raise LocalLLMError(
                    f"the llama.cpp backend has no {t} KV cache (it has {', '.join(_GGML_TYPE)})"
                )
        if type_v not in ("f32", "f16", "bf16") and flash_attn is False:
            raise LocalLLMError("a quantized V cache needs flash attention")
        if flash_attn is None:
            # On, as llama.cpp's own default (auto) has it on CPU: its non-flash path with an f16 KV
            # cache evaluated prompt batches wrongly on an AMD EPYC (Zen 3) here, llama-cpp-python
            # 0.3.36, any build (answers like "🌟🌟🌟" where token-by-token evaluation was right);
            # with flash attention they agree (bit for bit on short prompts; a long prompt in one
            # batch or in chunks differs by rounding, a few tenths of a nat at most).
            flash_attn = True
        self.model_path = str(path)
        self.n_threads = n_threads or default_threads()
        n_slots = max(1, int(n_slots))
        _init_backend(llama_cpp)
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers  # as `Llama` does
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx * n_slots
        cp.n_seq_max = n_slots
        cp.kv_unified = False  # each sequence its own `n_ctx` cells, attending to those only
        cp.n_batch = cp.n_ubatch = max(1, max_batch)
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)  # fmt: skip
        cp.type_k, cp.type_v = _GGML_TYPE[type_k], _GGML_TYPE[type_v]
        # RoPE/YaRN settings as llama-cpp-python's `Llama` passes them (llama.cpp's own defaults
        # are -1, "from the file"): the golden tests compare our answers with `Llama`'s
        cp.yarn_ext_factor, cp.yarn_attn_factor = -1.0, 1.0
        cp.yarn_beta_fast, cp.yarn_beta_slow = 32.0, 1.0
        mark = log_mark()
        self._model = self._ctx = None
        try:
            self._model = _internals.LlamaModel(path_model=self.model_path, params=mp,
                                                verbose=False)  # fmt: skip
            self._ctx = _internals.LlamaContext(model=self._model, params=cp, verbose=False)
        except (ValueError, RuntimeError) as e:  # llama-cpp-python's words hide llama.cpp's reason
            if self._model is not None:
                self._model.close()
            said = recent_errors(mark)
            said = [ln for ln in said if "error" in ln.lower()] or said
            reason = said[-1] if said else str(e).split(":")[0]
            raise LocalLLMError(f"llama.cpp cannot load it: {_strip_prefix(reason)}") from None
        ctx = self._ctx.ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self.n_slots = n_slots
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(ctx))  # per sequence, as llama.cpp rounded it
        self.max_batch = int(llama_cpp.llama_n_batch(ctx))  # llama.cpp caps it at the context
        self._slots = [_Slot(i) for i in range(n_slots)]
        self._stamp = 0
        self._batch = _Batch(llama_cpp, self.max_batch)
        self._vocab = self._model.vocab
        self._n_vocab = self._model.n_vocab()
        self._piece_buf = ctypes.create_string_buffer(256)
        self._embedder = None
        self._embed_lock = threading.Lock()
        try:
            meta = self._model.metadata()
        except Exception:  # noqa: BLE001 - as `Llama`: a file whose metadata cannot be listed has none
            meta = {}
        bos, eos = self._model.token_bos(), self._model.token_eos()
        self.chat_template = template_for(
            meta,
            bos_token=self._piece(bos) if bos >= 0 else "",
            eos_token=self._piece(eos) if eos >= 0 else "",
        )
        self.has_template = "tokenizer.chat_template" in meta
        self.llm = _SlotZero(self)
        self.speculative = speculative if speculative_mode(speculative) != "off" else None
        self.draft_name: str | None = None
        self._draft: _DraftContext | None = None
        if speculative_mode(speculative) == "draft" and draft is None:
            raise LocalLLMError(f"--speculative {speculative}: no draft model was given")
        if draft is not None:
            _same_vocabulary(self.model_path, draft)
            self.draft_name = draft[0]
            self._draft = _DraftContext(llama_cpp, draft[1], n_ctx=self.n_ctx, n_slots=n_slots,
                                        n_batch=self.max_batch, n_threads=self.n_threads,
                                        n_gpu_layers=mp.n_gpu_layers)  # fmt: skip

    # -- tokens --------------------------------------------------------------------------------

    def _piece(self, token: int) -> str:
        return self._model.detokenize([token], special=True).decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self._model.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    @property
    def n_vocab(self) -> int:
        return int(self._lib.llama_vocab_n_tokens(self._vocab))

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one generated token (no leading-space stripping: it follows the prompt)."""
        n = self._lib.llama_token_to_piece(
            self._vocab, token, self._piece_buf, len(self._piece_buf), 0, False
        )
        if n < 0:  # the buffer is too small: grow it to what llama.cpp asked for
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, self._piece_buf, -n, 0, False)
        return self._piece_buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._model.detokenize(list(tokens)).decode("utf-8", "replace")

    def is_end(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def bos_text(self) -> str:
        return self.chat_template.bos_token

    # -- slots ---------------------------------------------------------------------------------

    def admit(self, seq: Seq) -> int:
        """Give `seq` a free slot and return the prompt tokens its cache already holds.

        The slot is, in this order: the one whose cache the prompt continues (keeping at least
        three quarters of it; the longest shared prefix first), an empty one (the lowest id:
        llama.cpp decodes neighbouring ids in one pass), or the one where the tokens reused minus
        the cached tokens thrown away is largest (least recently used on ties). So a chat sharing
        only a system prompt with another leaves the other's cache for its next turn. At least one
        prompt token is always left to evaluate, for its logits.
        """
        free = [s for s in self._slots if s.seq is None]
        if not free:
            raise LocalLLMError(f"all {self.n_slots} llama.cpp slots are busy")
        drafter, pace = self._drafter(seq)  # what it refuses, it refuses before taking a slot
        limit = len(seq.ids) - 1
        shared = {s: common_prefix(s.tokens, seq.ids, limit) for s in free}
        kept = [s for s in free if s.tokens and shared[s] >= _KEEP_SHARE * len(s.tokens)]
        empty = [s for s in free if not s.tokens]
        if kept:
            slot = max(kept, key=lambda s: (shared[s], -s.sid))
        elif empty:
            slot = empty[0]
        else:
            slot = max(free, key=lambda s: (2 * shared[s] - len(s.tokens), -s.stamp))
        reuse = shared[slot]
        hit = seq.prefix
        seq.prefix = None
        if hit is not None and hit.n > reuse:  # the prefix cache has more: restore it instead
            if not kept and empty:
                slot = empty[0]
            state, _ = hit.pieces[-1]
            if self._restore(slot, state, hit.n):
                slot.tokens, reuse, seq.prefix = list(seq.ids[: hit.n]), hit.n, hit
            else:
                slot.tokens, reuse = [], 0
        self._lib.llama_memory_seq_rm(self._mem, slot.sid, reuse, -1)
        del slot.tokens[reuse:]
        slot.n_past, slot.exact = reuse, True
        slot.seq, slot.fed, slot.last, slot.shifted = seq, reuse, None, []
        slot.chain = self._sampler(seq.sampling)
        slot.history = list(seq.ids)
        slot.drafter, slot.pace = drafter, pace
        self._stamp += 1
        slot.stamp = self._stamp
        seq.state = slot
        return reuse

    def _drafter(self, seq: Seq) -> tuple[Any, Pace | None]:
        spec = seq.speculative if seq.speculative is not None else self.speculative
        mode = speculative_mode(spec)
        if mode == "off":
            return None, None
        if seq.policy.enabled:
            raise LocalLLMError(_NO_SHIFT_SPECULATION)
        if mode == "lookup":
            return Lookup(), Pace(LOOKUP_K, LOOKUP_K // 2, give_up=False)
        if mode == "draft" and self._draft is not None and spec == f"draft:{self.draft_name}":
            return _DraftProposer(self._draft), Pace(DRAFT_K, DRAFT_K // 2)
        if mode == "draft":
            raise LocalLLMError(
                f"--speculative {spec}: this model was loaded "
                + (f"with the draft model {self.draft_name}" if self.draft_name else "without a draft model")
                + "; load it with that --speculative to use another"
            )
        raise LocalLLMError(f"the llama.cpp backend has no speculative mode {mode!r} "
                            "(the torch backend has it: --backend torch)")  # fmt: skip

    # -- the prefix cache (`localllm.prefix_cache`): sequence states in host memory ------------

    prefix_kind = "full"
    prefix_budget = 512 * 2**20  # bytes of saved states the engine may keep

    def prefix_tokens(self, seq: Seq) -> list[int]:
        """The tokens a finishing sequence's cells hold exactly (none after a context shift)."""
        slot = seq.state
        if not isinstance(slot, _Slot) or not slot.exact:
            return []
        return list(slot.tokens[: slot.n_past])

    def prefix_save(self, seq: Seq, start: int, end: int) -> _State | None:
        """The sequence's cells [0, end) as llama.cpp saves a sequence (its whole state)."""
        slot = seq.state
        if end != slot.n_past:
            return None
        lib, ctx = self._lib, self._ctx.ctx
        size = lib.llama_state_seq_get_size_ext(ctx, slot.sid, 0)
        buf = (ctypes.c_uint8 * size)()
        n = lib.llama_state_seq_get_data_ext(ctx, buf, size, slot.sid, 0)
        return _State(bytes(buf)[:n], end) if n else None

    def _restore(self, slot: _Slot, state: _State, n: int) -> bool:
        """Load a saved state into the slot's cells and keep its first `n` positions."""
        lib = self._lib
        lib.llama_memory_seq_rm(self._mem, slot.sid, 0, -1)
        buf = (ctypes.c_uint8 * len(state.data)).from_buffer_copy(state.data)
        if not lib.llama_state_seq_set_data_ext(self._ctx.ctx, buf, len(state.data), slot.sid, 0):
            lib.llama_memory_seq_rm(self._mem, slot.sid, 0, -1)
            return False
        lib.llama_memory_seq_rm(self._mem, slot.sid, n, -1)
        return True

    @property
    def busy(self) -> int:
        """Slots holding a sequence."""
        return sum(s.seq is not None for s in self._slots)

    def release(self, seq: Seq, keep: bool = True) -> None:
        """Free the slot; `keep` leaves its cache (and the tokens it holds) for prefix reuse."""
        slot = seq.state
        if not isinstance(slot, _Slot) or slot.seq is not seq:
            return
        seq.state = None
        slot.seq = slot.last = slot.drafter = slot.pace = None
        slot.history = []
        if slot.chain is not None:
            self._lib.llama_sampler_free(slot.chain)
            slot.chain = None
        if not keep:
            self._clear(slot)

    def drop_caches(self) -> None:
        """Forget what every free slot's cache holds: the next prompts are evaluated afresh."""
        for slot in self._slots:
            if slot.seq is None:
                self._clear(slot)

    def _clear(self, slot: _Slot) -> None:
        self._lib.llama_memory_seq_rm(self._mem, slot.sid, 0, -1)
        slot.tokens, slot.n_past, slot.exact = [], 0, True

    # -- one step ------------------------------------------------------------------------------

    def step(self, plan: Mapping[Seq, int]) -> dict[Seq, list[Step]]:
        """Evaluate every planned sequence: `plan[seq]` more prompt tokens, or (0) the token it
        sampled last; sample a token for each one whose prompt is complete.

        The prompt chunks go in one `llama_decode`, the decoding sequences' tokens in the next.
        llama.cpp evaluates a batch over sequences with separate cells (`kv_unified` off) in
        passes of equally many tokens per sequence anyway, and a pass's attention spans the longest
        cache in it: a prompt token at position 3,000 beside three short decoders made their pass
        cost 30-50 ms more here (measured with 4-token chunks: 180-200 ms a step against 145-155).
        Prompts first: a prompt llama.cpp refuses fails the step before any decoder moved.

        A sequence under a StreamingLLM policy evaluates its prompt chunk in pieces of at most half
        its window, shifting its cache before each; those pieces go in further decodes. A decoding
        sequence whose context is full and may not shift gets no Step (the engine says "length").
        """
        t0 = time.perf_counter()
        decoding: dict[_Slot, deque[list[int]]] = {}
        prefill: dict[_Slot, deque[list[int]]] = {}
        due: set[_Slot] = set()  # slots that sample after their last piece
        drafts: dict[_Slot, Draft] = {}  # speculating slots: what they verify this step
        out: dict[Seq, list[Step]] = {}
        for seq, n in plan.items():
            slot = seq.state
            if not isinstance(slot, _Slot) or slot.seq is not seq:
                raise LocalLLMError("a sequence was stepped that holds no llama.cpp slot")
            if slot.last is None:  # prefilling
                left = len(seq.ids) - slot.fed
                tokens = seq.ids[slot.fed : slot.fed + (min(n, left) if n > 0 else left)]
                if slot.fed + len(tokens) == len(seq.ids):
                    due.add(slot)
                size = self._piece_size(seq)
                # the prompt's last token goes alone, as it does when a cached prefix is reused:
                # llama.cpp's CPU kernels give a row of a many-row batch other rounding than a
                # row alone, and a greedy answer then depended on whether the prefix was cached
                body = tokens[:-1] if slot in due else tokens
                prefill[slot] = deque(body[i : i + size] for i in range(0, len(body), size))
                if slot in due:
                    prefill[slot].append(tokens[-1:])
            elif not seq.policy.enabled and slot.n_past + 1 > self.n_ctx:
                out[seq] = []  # the context is full
            else:
                piece = [slot.last]
                if slot.pace is not None and slot.pace.on:
                    k = self._draft_room(slot)
                    drafts[slot] = slot.drafter.propose(slot, k) if k > 0 else Draft([])
                    piece += drafts[slot].tokens
                decoding[slot] = deque([piece])
                due.add(slot)
        for pieces in (prefill, decoding):
            order = sorted(pieces, key=lambda s: s.sid)  # llama.cpp splits a batch at gaps in ids
            while True:
                batch: list[tuple[_Slot, list[int], bool]] = []
                room = self.max_batch
                for slot in order:
                    queue = pieces[slot]
                    if not queue or (batch and len(queue[0]) > room):
                        continue
                    piece = queue.popleft()
                    self._make_room(slot, len(piece))
                    # logits: none mid-prompt, the last token's, or every one a draft verifies
                    want = (len(piece) if slot in drafts else 1) if not queue and slot in due else 0
                    batch.append((slot, piece, want))
                    room -= len(piece)
                if not batch:
                    break
                rows = self._decode(batch)
                for slot, piece, _ in batch:
                    if slot.last is None:
                        slot.fed += len(piece)
                for slot, row in rows.items():
                    if slot in drafts:
                        out[slot.seq] = self._verify(slot, row, drafts[slot], t0)
                    else:
                        step = self._sample(slot, row)
                        out[slot.seq] = [replace(step, passes=1) if slot in decoding else step]
        return out

    def _draft_room(self, slot: _Slot) -> int:
        """Tokens a speculating slot may draft now: what its pace wants, within its context,
        its max_tokens and one batch."""
        seq = slot.seq
        assert seq is not None and slot.pace is not None
        k = min(slot.pace.want(), self.n_ctx - slot.n_past - 1, self.max_batch - 1)
        if seq.sampling.max_tokens:
            k = min(k, seq.sampling.max_tokens - (len(slot.history) - len(seq.ids)) - 1)
        return k

    def _verify(self, slot: _Slot, row: int, draft: Draft, t0: float) -> list[Step]:
        """Keep the drafts the target's own choices agree with, row by row: each row is sampled
        with the sequence's chain (or its argmax), and a draft survives while it is what was
        chosen. For a deterministic drafter (lookup, a greedy draft model: q one-hot) that is
        exactly the rule u ≤ p(x)/q(x) with the residual p without x. The rest of the batch's
        cells are removed from the cache."""
        pace = slot.pace
        assert pace is not None
        if not draft.tokens:
            step = self._sample(slot, row)
            pace.plain(time.perf_counter() - t0)
            return [replace(step, passes=1)]
        steps: list[Step] = []
        for i, x in enumerate(draft.tokens):
            steps.append(self._sample(slot, row + i))
            if steps[-1].token != x:
                break
        else:
            steps.append(self._sample(slot, row + len(draft.tokens)))
        n = len(steps) - 1
        rejected = len(draft.tokens) - n
        if rejected:
            self._lib.llama_memory_seq_rm(self._mem, slot.sid, slot.n_past - rejected, -1)
            slot.n_past -= rejected
            if slot.exact:
                del slot.tokens[-rejected:]
        pace.verified(len(draft.tokens), n, time.perf_counter() - t0)
        steps[0] = replace(steps[0], passes=1, drafted=len(draft.tokens), accepted=n)
        if not pace.on:
            steps[-1] = replace(steps[-1], spec_off=pace.reason)
        return steps

    def _sample(self, slot: _Slot, row: int) -> Step:
        seq = slot.seq
        if seq.constraint is not None:  # in place: the sampler chain reads the same buffer
            seq.constraint.mask_numpy(self._logits(row))
        if slot.chain is None:  # plain greedy: the first largest logit, as llama.cpp's
            token = int(self._logits(row).argmax())
        else:
            token = self._lib.llama_sampler_sample(slot.chain, self._ctx.ctx, row)
        if seq.constraint is not None:
            seq.constraint.consume(token)
        logprob, top = None, ()
        if seq.sampling.logprobs is not None:
            logprob, top = self._logprobs(row, token, seq.sampling.logprobs)
        step = Step(token, shifted=tuple(slot.shifted), logprob=logprob, top=top)
        slot.shifted = []
        slot.last = token
        slot.history.append(token)
        return step

    def _piece_size(self, seq: Seq) -> int:
        policy = seq.policy
        if not policy.enabled:
            return self.max_batch
        room = min(self.n_ctx, (policy.sinks or 0) + policy.window) - (policy.sinks or 0)
        return max(1, min(self.max_batch, policy.window // 2, room))

    def _make_room(self, slot: _Slot, need: int) -> None:
        """Before `need` more tokens: shift the slot's cache if its policy says so and it must."""
        seq = slot.seq
        policy = seq.policy if seq is not None else None
        if policy is None or not policy.enabled:
            if slot.n_past + need > self.n_ctx:
                raise ContextOverflow(
                    f"{slot.n_past + need} tokens do not fit the context of {self.n_ctx}"
                )
            return
        keep = policy.sinks or 0
        capacity = min(self.n_ctx, keep + policy.window)
        n_past = slot.n_past
        if n_past + need <= capacity:
            return
        discard = min(max(n_past + need - capacity, policy.window // 4), n_past - keep)
        if discard <= 0 or n_past - discard + need > capacity:
            raise LocalLLMError(
                "the context cannot hold the sinks and one batch; use a larger --ctx"
            )
        lib = self._lib
        if not lib.llama_memory_can_shift(self._mem):
            raise LocalLLMError("this model's cache cannot be shifted; use a larger --ctx instead")
        lib.llama_memory_seq_rm(self._mem, slot.sid, keep, keep + discard)
        lib.llama_memory_seq_add(self._mem, slot.sid, keep + discard, n_past, -discard)
        slot.n_past = n_past - discard
        if slot.exact:  # shifted rows are not what a fresh evaluation gives: reuse the sinks only
            del slot.tokens[keep:]
            slot.exact = False
        slot.shifted.append(discard)

    def _decode(self, batch: Sequence[tuple[_Slot, Sequence[int], int]]) -> dict[_Slot, int]:
        """One `llama_decode`: each slot's tokens at its next positions, with the logits of its
        last `want` tokens (0, 1, or all a draft verifies). Returns the batch row of each slot's
        first logits. On failure the cells the batch added are removed again, so every slot's
        cache stays what it was before this call."""
        b = self._batch
        rows: dict[_Slot, int] = {}
        n = 0
        for slot, tokens, want in batch:
            k = len(tokens)
            if k == 1:  # a decode step: scalar stores are several times cheaper than slices
                b.token[n], b.pos[n], b.seq_id[n], b.logits[n] = tokens[0], slot.n_past, slot.sid, 0
            else:
                b.token[n : n + k] = tokens
                b.pos[n : n + k] = np.arange(slot.n_past, slot.n_past + k)
                b.seq_id[n : n + k] = slot.sid
                b.logits[n : n + k] = 0
            if want:
                b.logits[n + k - want : n + k] = 1
                rows[slot] = n + k - want
            n += k
        mark = log_mark()
        rc = b.decode(self._ctx.ctx, n)
        if rc != 0:
            for slot, _, _ in batch:
                self._lib.llama_memory_seq_rm(self._mem, slot.sid, slot.n_past, -1)
            said = recent_errors(mark)
            why = f": {_strip_prefix(said[-1])}" if said else ""
            raise LocalLLMError(
                f"llama.cpp could not evaluate a batch of {n} tokens "
                f"(llama_decode returned {rc}{why})"
            )
        for slot, tokens, _ in batch:
            slot.n_past += len(tokens)
            if slot.exact:
                slot.tokens.extend(tokens)
        return rows

    # -- sampling ------------------------------------------------------------------------------

    def _sampler(self, s: SamplingParams):  # noqa: ANN202
        """The sequence's llama.cpp sampler chain; None for plain greedy (an argmax over the
        logits row: llama.cpp's greedy sampler copies all n_vocab candidates first, ~0.2 ms)."""
        penalties = s.repeat_penalty != 1.0 or s.frequency_penalty or s.presence_penalty
        if s.temperature == 0 and not penalties:
            return None
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lambda smpl: lib.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        if penalties:
            add(lib.llama_sampler_init_penalties(s.repeat_last_n, s.repeat_penalty,
                                                 s.frequency_penalty, s.presence_penalty))  # fmt: skip
        if s.temperature == 0:
            add(lib.llama_sampler_init_greedy())
        else:
            if s.top_k > 0:
                add(lib.llama_sampler_init_top_k(s.top_k))
            add(lib.llama_sampler_init_top_p(s.top_p, 1))
            add(lib.llama_sampler_init_min_p(s.min_p, 1))
            add(lib.llama_sampler_init_temp(s.temperature))
            seed = s.seed if s.seed is not None else lib.LLAMA_DEFAULT_SEED
            add(lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def _logits(self, row: int) -> Any:
        """The logits of a batch row, as a numpy view of llama.cpp's buffer: (n_vocab,) float32."""
        ptr = self._lib.llama_get_logits_ith(self._ctx.ctx, row)
        if not ptr:
            raise LocalLLMError(f"llama.cpp has no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _logprobs(self, row: int, token: int,
                  n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:  # fmt: skip
        logits = self._logits(row).astype(np.float64)
        m = logits.max()
        logz = m + math.log(float(np.exp(logits - m).sum()))
        top = np.argsort(-logits)[:n_top] if n_top else []
        return float(logits[token] - logz), tuple((int(i), float(logits[i] - logz)) for i in top)

    # -- the rest ------------------------------------------------------------------------------

    def scorer(self, policy: ContextPolicy | None = None) -> LlamaScorer:
        """Logits for every position of a text through slot 0 (`localllm eval`)."""
        return LlamaScorer(self, policy or ContextPolicy())

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalised embeddings from a second context made for embedding."""
        with self._embed_lock:
            if self._embedder is None:
                with templates_not_compiled():
                    self._embedder = self._lib.Llama(
                        model_path=self.model_path, n_ctx=self.n_ctx, n_batch=self.n_ctx,
                        n_ubatch=self.n_ctx, n_threads=self.n_threads, embedding=True,
                        pooling_type=self._lib.LLAMA_POOLING_TYPE_MEAN, verbose=False,
                    )  # fmt: skip
            for t in texts:
                n = len(self._embedder.tokenize(t.encode("utf-8"), special=True))
                if n > self.n_ctx:
                    raise ContextOverflow(
                        f"an input has {n} tokens but the context holds {self.n_ctx}"
                    )
            vectors = self._embedder.embed(list(texts), normalize=True, truncate=False)
        return [[float(x) for x in v] for v in vectors]

    def close(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        for slot in self._slots:
            if slot.chain is not None:
                self._lib.llama_sampler_free(slot.chain)
                slot.chain = None
        if self._draft is not None:
            self._draft.close()
            self._draft = None
        if self._ctx is not None:
            self._ctx.close()
            self._model.close()
            self._ctx = self._model = None



class LlamaScorer:
    """Feeds a text through slot 0's cells and returns the logits after every token
    (`localllm eval`); under a StreamingLLM policy the cache rolls one token at a time once full
    (llama.cpp's context shift with `n_keep` sinks and `n_discard` 1), so `token_by_token`.

    Whole chunks are otherwise what generation computes: llama.cpp writes a batch's keys and
    values into the cache (quantized there) before its attention reads them back."""

    def __init__(self, backend: LlamaCppBackend, policy: ContextPolicy) -> None:
        self.b, self.policy = backend, policy
        self.slot = backend._slots[0]
        if self.slot.seq is not None:
            raise LocalLLMError("slot 0 is generating")
        backend.drop_caches()
        if policy.enabled and not backend._lib.llama_memory_can_shift(backend._mem):
            raise LocalLLMError("this model's cache cannot be shifted (--streaming)")
        self.token_by_token = policy.enabled
        self.chunk = 1 if policy.enabled else backend.max_batch
        self.shifts = 0

    def feed(self, tokens: Sequence[int]) -> Any:
        """numpy float32 (len(tokens), vocab): the logits after each of `tokens`."""
        b, slot, lib = self.b, self.slot, self.b._lib
        n = len(tokens)
        if self.policy.enabled:
            keep = self.policy.sinks or 0
            capacity = min(b.n_ctx, keep + self.policy.window)
            if n > 1:
                raise LocalLLMError("a rolling cache is fed one token at a time")
            if slot.n_past + 1 > capacity:  # forget the oldest token after the sinks
                lib.llama_memory_seq_rm(b._mem, slot.sid, keep, keep + 1)
                lib.llama_memory_seq_add(b._mem, slot.sid, keep + 1, slot.n_past, -1)
                slot.n_past -= 1
                self.shifts += 1
        elif slot.n_past + n > b.n_ctx:
            raise ContextOverflow(f"{slot.n_past + n} tokens do not fit the context of {b.n_ctx}")
        batch = b._batch
        batch.token[:n] = tokens
        batch.pos[:n] = np.arange(slot.n_past, slot.n_past + n)
        batch.seq_id[:n] = slot.sid
        batch.logits[:n] = 1
        rc = batch.decode(b._ctx.ctx, n)
        if rc != 0:
            lib.llama_memory_seq_rm(b._mem, slot.sid, slot.n_past, -1)
            raise LocalLLMError(f"llama.cpp could not evaluate {n} tokens (llama_decode returned {rc})")
        slot.n_past += n
        slot.tokens = []  # what it holds is no prompt prefix any more
        ptr = lib.llama_get_logits(b._ctx.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, b._n_vocab)).copy()


def _same_vocabulary(path: str | Path, draft: tuple[str, str | Path]) -> None:
    """A draft model must tokenize as the model does: the same token list (read from the files)."""
    from localllm.gguf_file import GGUFFile

    with GGUFFile(path) as f, GGUFFile(draft[1]) as g:
        mine = list(f.metadata.get("tokenizer.ggml.tokens") or ())
        theirs = list(g.metadata.get("tokenizer.ggml.tokens") or ())
    if mine != theirs:
        raise LocalLLMError(f"the draft model {draft[0]} has another vocabulary ({len(theirs)} "
                            f"tokens) than the model ({len(mine)}): a draft must share it")  # fmt: skip


class _DraftContext:
    """A draft model in a llama.cpp context of its own, one sequence per slot of the target's.

    Each sequence remembers the tokens its cells hold, so a draft catches up with the target by
    evaluating only what the target accepted since (the prompt at first), and what it drafted
    past that is removed on the next catch-up. Drafts are greedy (the argmax): a deterministic
    drafter, which the target verifies by sampling and comparing (`LlamaCppBackend._verify`)."""

    def __init__(self, lib: Any, path: str | Path, *, n_ctx: int, n_slots: int, n_batch: int,
                 n_threads: int, n_gpu_layers: int) -> None:  # fmt: skip
        from llama_cpp import _internals

        self._lib = lib
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        mp.load_mode = lib.LLAMA_LOAD_MODE_MMAP
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = n_ctx * n_slots, n_slots, False
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        mark = log_mark()
        self._model = self._ctx = None
        try:
            self._model = _internals.LlamaModel(path_model=str(path), params=mp, verbose=False)
            self._ctx = _internals.LlamaContext(model=self._model, params=cp, verbose=False)
        except (ValueError, RuntimeError) as e:
            if self._model is not None:
                self._model.close()
            said = recent_errors(mark)
            reason = _strip_prefix(said[-1]) if said else str(e).split(":")[0]
            raise LocalLLMError(f"llama.cpp cannot load the draft model: {reason}") from None
        self._mem = lib.llama_get_memory(self._ctx.ctx)
        self.n_ctx = int(lib.llama_n_ctx_seq(self._ctx.ctx))
        self.n_batch = n_batch
        self._n_vocab = self._model.n_vocab()
        self._batch = _Batch(lib, n_batch)
        self.held: dict[int, list[int]] = {i: [] for i in range(n_slots)}

    def _eval(self, sid: int, tokens: Sequence[int], logits: bool) -> None:
        held = self.held[sid]
        b, k = self._batch, len(tokens)
        b.token[:k] = tokens
        b.pos[:k] = np.arange(len(held), len(held) + k)
        b.seq_id[:k] = sid
        b.logits[:k] = 0
        if logits:
            b.logits[k - 1] = 1
        rc = b.decode(self._ctx.ctx, k)
        if rc != 0:
            self._lib.llama_memory_seq_rm(self._mem, sid, len(held), -1)
            raise LocalLLMError(f"llama.cpp could not evaluate the draft (llama_decode returned {rc})")
        held.extend(tokens)

    def propose(self, sid: int, context: Sequence[int], last: int, k: int) -> list[int]:
        """Up to k greedy tokens after `context` + [last]."""
        held = self.held[sid]
        keep = common_prefix(held, context, len(context))
        self._lib.llama_memory_seq_rm(self._mem, sid, keep, -1)
        del held[keep:]
        for i in range(keep, len(context), self.n_batch):
            self._eval(sid, context[i : i + self.n_batch], logits=False)
        out: list[int] = []
        tok = last
        for _ in range(max(0, min(k, self.n_ctx - len(held) - 1))):
            self._eval(sid, [tok], logits=True)
            ptr = self._lib.llama_get_logits_ith(self._ctx.ctx, 0)
            tok = int(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).argmax())
            out.append(tok)
        return out

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._model.close()
            self._ctx = self._model = None


class _DraftProposer:
    """One slot's view of the draft context (a `Drafter`)."""

    def __init__(self, draft: _DraftContext) -> None:
        self.draft = draft

    def propose(self, slot: _Slot, k: int) -> Draft:
        if not slot.exact:
            return Draft([])  # the target's cache was shifted: no exact prefix to follow
        return Draft(self.draft.propose(slot.sid, slot.tokens, slot.last, k))  # type: ignore[arg-type]


class _Batch:
    """A `llama_batch` over numpy arrays (one sequence id per token), refilled every step."""

    def __init__(self, lib: Any, size: int) -> None:
        self._lib = lib
        self.token = np.zeros(size, np.int32)
        self.pos = np.zeros(size, np.int32)
        self.n_seq_id = np.ones(size, np.int32)
        self.seq_id = np.zeros(size, np.int32)
        self.logits = np.zeros(size, np.int8)
        i32 = ctypes.POINTER(ctypes.c_int32)
        base, width = self.seq_id.ctypes.data, self.seq_id.itemsize
        self._rows = (i32 * size)(*(ctypes.cast(base + i * width, i32) for i in range(size)))
        b = lib.llama_batch()
        b.token = self.token.ctypes.data_as(i32)
        b.embd = None
        b.pos = self.pos.ctypes.data_as(i32)
        b.n_seq_id = self.n_seq_id.ctypes.data_as(i32)
        b.seq_id = ctypes.cast(self._rows, ctypes.POINTER(i32))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.batch = b

    def decode(self, ctx: Any, n: int) -> int:
        self.batch.n_tokens = n
        return int(self._lib.llama_decode(ctx, self.batch))


class _SlotZero:
    """Slot 0 behind the few `Llama` members older callers use: `llamacpp_guard`'s batch-versus-
    token-by-token probe (`eval`, `reset`, `ctx`, `n_vocab`) and bench/llamacpp_overhead.py
    (`model_path`, `reset`). Only while no sequence holds a slot."""

    def __init__(self, backend: LlamaCppBackend) -> None:
        self._b = backend

    @property
    def ctx(self) -> Any:
        return self._b._ctx.ctx

    @property
    def model_path(self) -> str:
        return self._b.model_path

    def n_vocab(self) -> int:
        return self._b._n_vocab

    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate `tokens` after what slot 0 holds; the last one's logits are row -1."""
        b, slot = self._b, self._b._slots[0]
        if slot.seq is not None:
            raise LocalLLMError("slot 0 is generating")
        for i in range(0, len(tokens), b.max_batch):
            b._decode([(slot, list(tokens[i : i + b.max_batch]), 1)])

    def reset(self) -> None:
        self._b.drop_caches()
