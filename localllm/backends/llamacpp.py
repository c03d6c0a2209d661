"""The llama.cpp runner: one llama.cpp context, one sequence per slot, pieces evaluated in batches.

The model and context are built through llama-cpp-python's low-level API (its `Llama` holds one
sequence): `n_slots` llama.cpp sequences, each with its own `n_ctx` cells (`kv_unified` off).
`forward` puts every slot's piece into one `llama_batch` (more when they exceed `max_batch`) and
copies out the logits asked for. It samples nothing, schedules nothing and speculates on nothing:
that is the engine's (`localllm.engine`); a draft model is a second runner the engine opens. A
slot under a StreamingLLM policy shifts its own cells before a piece that would not fit, as
llama.cpp's context shift does, and says how many positions it forgot (`Forward.shifted`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from localllm.backends import LLAMACPP as CAPABILITIES
from localllm.backends.base import (
    MEDIA_MARKER,
    MEDIA_SPAN,
    Forward,
    NoDraftHead,
    Piece,
    TextOnly,
    media_id,
    media_of,
)
from localllm.chat import template_for
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.gguf_file import GGML_TYPE_BY_NAME
from localllm.home import default_home
from localllm.memory import kv_types, parse_kv_cache
from localllm.types import ContextPolicy

_GGML_TYPE = {t: GGML_TYPE_BY_NAME[t.upper()].id for t in kv_types("llama.cpp")}  # name -> ggml id


def open_runner(path: str | Path, options: Any, *, name: str, digest: str,
                home: Path | None = None, projector: Path | None = None) -> LlamaCppRunner:  # fmt: skip
    """The registry's factory: the first load of a file runs in a child (a file llama.cpp would
    abort on is refused there), then the model loads here with the options' context and cache,
    and its vision projector (`projector`, an mmproj GGUF) when it has one. A draft model is
    opened the same way, by the engine, as a runner of its own."""
    from localllm.backends.llamacpp_guard import check_load

    placement = gpu_placement(path, options)
    failed: tuple[Any, str] | None = None  # the plan that ran out of GPU memory, llama.cpp's words
    while True:
        n_gpu_layers = placement.gpu_layers if placement else 0
        try:
            # the child checks the file with one layer on the GPU (the GPU path, little memory)
            check_load(path, digest, name, n_gpu_layers=min(n_gpu_layers, 1), home=home)
            runner = LlamaCppRunner(
                path, n_ctx=options.ctx or 4096, n_slots=options.parallel,
                kv_cache=options.kv_cache, n_threads=options.threads, n_gpu_layers=n_gpu_layers,
                tensor_split=placement.tensor_split if placement else (),
                cpu_moe=placement.cpu_moe if placement else 0, projector=projector,
            )  # fmt: skip
        except LocalLLMError as e:
            # a GPU that had less room than it said (another program, the driver's own needs):
            # once, the planner's next smaller plan; the error says both tries
            said = str(e)
            smaller = (_smaller_placement(path, options, placement)
                       if placement and failed is None and _out_of_memory(said) else None)  # fmt: skip
            if smaller is None:
                after = f" (after: {failed[0].text()}: {failed[1]})" if failed else ""
                raise LocalLLMError(said + after) from None
            failed, placement = (placement, said), smaller
            continue
        runner.placement = placement
        if failed:
            runner.placement_note = (f"GPU memory ran out with {failed[0].text()}; loaded with "
                                     f"{placement.text()} instead")  # fmt: skip
        return runner


def gpu_placement(path: str | Path, options: Any) -> Any:
    """The offload plan (`memory.plan`) for loading `path` with `options`, or None where
    everything stays on the CPU: --device cpu, no GPU in the device inventory, or a llama.cpp
    build without a GPU backend."""
    from localllm.devices import inventory
    from localllm.memory import plan
    from localllm.model_info import read_model_info

    if options.device == "cpu":
        return None
    inv = inventory()
    if not inv.gpus or not gpu_offload():
        return None
    return plan(read_model_info(str(path)), inv, ctx=options.ctx, kv_cache=options.kv_cache,
                parallel=options.parallel, **options.placement)  # fmt: skip


def _smaller_placement(path: str | Path, options: Any, last: Any) -> Any:
    from localllm.devices import inventory
    from localllm.memory import smaller_plan
    from localllm.model_info import read_model_info

    return smaller_plan(read_model_info(str(path)), inventory(fresh=True), last, ctx=options.ctx,
                        kv_cache=options.kv_cache, parallel=options.parallel,
                        **options.placement)  # fmt: skip


def _out_of_memory(said: str) -> bool:
    """llama.cpp's words for a buffer it could not have ("failed to allocate CUDA0 buffer",
    "out of memory")."""
    said = said.lower()
    return "alloc" in said or "memory" in said


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan, ROCm)."""
    return bool(quiet_llama_log().llama_supports_gpu_offload())


NO_LAYER_SKIP = "llama.cpp cannot leave layers out (layer-skip drafts need --backend torch)"


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


# -- llama.cpp's log: into a file in the store, never onto the user's terminal ------------------

LOG_FILE = "logs/llama.cpp.log"
_LOG_MAX = 8 << 20  # rotate to llama.cpp.log.1 past this size
_log_lock = threading.Lock()
_log_state: dict[str, object] = {}
_recent: collections.deque[tuple[int, int, str]] = collections.deque(
    maxlen=64
)  # (seq, level, line)
_LEVELS = {0: "NONE", 1: "DEBUG", 2: "INFO", 3: "WARN", 4: "ERROR"}  # ggml_log_level; 5 = CONT


def log_path() -> Path:
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
                with contextlib.suppress(ValueError, OSError):  # closed at the interpreter's exit
                    f.write(f"{stamp} {_LEVELS.get(level, level)} {ln}\n")  # type: ignore[attr-defined]
        if done and f is not None:
            with contextlib.suppress(ValueError, OSError):
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


class _State:
    """A prefix-cache handle: a sequence's saved cells (positions 0 .. end-1), as llama.cpp saves
    a sequence (`prefix_kind` "full": one handle holds its whole prefix)."""

    def __init__(self, data: bytes, end: int) -> None:
        self.data, self.end = data, end
        self.nbytes = len(data)


class LlamaCppRunner(NoDraftHead):
    """A `localllm.backends.base.Runner` over one llama.cpp context: `n_slots` sequences."""

    name = "llama.cpp"
    capabilities = CAPABILITIES
    dtype = "auto"  # the file's own types; llama.cpp computes in them
    prefix_kind = "full"  # a handle is a whole sequence state: one restores a prefix
    logits_on_device = False  # its logits come to the host; the engine samples there
    prefix_budget = 512 * 2**20  # bytes of saved states the engine may keep

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
        tensor_split: Sequence[float] = (),
        cpu_moe: int = 0,
        flash_attn: bool | None = None,
        projector: str | Path | None = None,
    ) -> None:
        """Args:
        n_ctx: cells per sequence (llama.cpp rounds it up to a multiple of 256).
        n_slots: sequences held at once, one llama.cpp sequence id each.
        max_batch: tokens one `llama_decode` may evaluate (llama.cpp's n_batch and n_ubatch).
        kv_cache: the K and V cache types ("q8_0", "k=q8_0,v=f16").
        n_gpu_layers: layers offloaded to the GPU (-1: all; 0: the CPU only; L+1: every layer
            and the output, as llama.cpp counts them).
        tensor_split: each GPU's share of the offloaded layers (empty: llama.cpp's, by memory).
        cpu_moe: layers (from the first) whose MoE experts stay in RAM.
        flash_attn: None is on (see below); a quantized V cache needs it.
        projector: a vision projector (mmproj GGUF) for this model: prompts may hold images.
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
        # kept on self: llama.cpp reads these arrays while the model loads
        self._split = None
        if tensor_split:
            self._split = (ctypes.c_float * llama_cpp.llama_max_devices())(*tensor_split)
            mp.tensor_split = self._split
        self._overrides = None
        if cpu_moe:
            from localllm.backends.ggml_devices import cpu_moe_overrides

            self._overrides = cpu_moe_overrides(cpu_moe)
            mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.placement: Any = None  # the plan it was loaded with (`memory.Plan`), when one
        self.placement_note = ""  # a retry with a smaller plan, said once
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
        self._embedder = None
        try:
            self._model = _internals.LlamaModel(path_model=self.model_path, params=mp,
                                                verbose=False)  # fmt: skip
            self._ctx = _internals.LlamaContext(model=self._model, params=cp, verbose=False)
        except (ValueError, RuntimeError) as e:  # llama-cpp-python's words hide llama.cpp's reason
            if self._model is not None:
                self._model.close()
                self._model = None
            said = recent_errors(mark)
            said = [ln for ln in said if "error" in ln.lower()] or said
            reason = said[-1] if said else str(e).split(":")[0]
            raise LocalLLMError(f"llama.cpp cannot load it: {_strip_prefix(reason)}") from None
        ctx = self._ctx.ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        gpu = n_gpu_layers != 0 and bool(llama_cpp.llama_supports_gpu_offload())
        self.device = "gpu" if gpu else "cpu"  # which GPU API the build uses is not asked cheaply
        self.device_name = "GPU" if gpu else "CPU"
        self.n_slots = n_slots
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(ctx))  # per sequence, as llama.cpp rounded it
        self.max_batch = int(llama_cpp.llama_n_batch(ctx))  # llama.cpp caps it at the context
        self.scoring_chunk = self.max_batch
        self.n_layers = int(llama_cpp.llama_model_n_layer(self._model.model))
        self._vocab = self._model.vocab
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._batch = _Batch(llama_cpp, self.max_batch)
        self._n_past = [0] * n_slots  # cells each sequence holds: its next token's position
        self._policy: list[ContextPolicy | None] = [None] * n_slots
        self._lock = threading.Lock()  # the context: forward and the cache operations
        self._kv_seen = 0  # kv_bytes' last answer, given while a forward runs
        self._piece_buf = ctypes.create_string_buffer(256)
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
        self._vision: _Vision | None = None
        self.media: tuple[str, ...] = ()
        if projector is not None:
            try:
                self._vision = _Vision(llama_cpp, self._model.model, str(projector), self.n_threads,
                                       gpu=gpu, max_batch=self.max_batch)  # fmt: skip
            except LocalLLMError:
                self.close()
                raise
            self.media = ("image",)

    # -- tokens --------------------------------------------------------------------------------

    def _piece(self, token: int) -> str:
        return self._model.detokenize([token], special=True).decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self._model.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

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

    def tokenize_media(self, text: str, images: Sequence[bytes], *,
                       add_special: bool = True) -> list[int]:  # fmt: skip
        """The tokens of `text`, each MEDIA_MARKER in it one of `images` (encoded by the
        projector now, once per distinct image): its positions as media ids."""
        if self._vision is None:
            return TextOnly.tokenize_media(self, text, images, add_special=add_special)  # type: ignore[arg-type]
        with self._lock:
            return self._vision.tokenize(text, images, add_special=add_special)

    # -- the forward pass ----------------------------------------------------------------------

    def forward(self, pieces: Sequence[Piece], *, skip: frozenset[int] = frozenset()) -> Forward:
        """Evaluate every piece at its slot's next positions; the logits of each piece's last
        `logits` tokens, in piece order: (sum of `logits`, n_vocab) float32, a copy.

        The pieces go into one `llama_batch` in slot order (llama.cpp splits a batch at gaps in
        sequence ids), more when they hold over `max_batch` tokens: a piece may then be split
        across decodes. A slot under a StreamingLLM policy takes at most half its window per
        decode and shifts its cells before each part that would not fit (`Forward.shifted`).
        Without a policy a piece that does not fit `n_ctx` raises `ContextOverflow` before
        anything is evaluated. A failed `llama_decode` removes every cell this call added (a
        slot shifted by this call stays shifted) and raises `LocalLLMError` quoting llama.cpp.
        """
        if skip:
            raise LocalLLMError(NO_LAYER_SKIP)
        if self._vision is not None and any(min(p.tokens, default=0) < 0 for p in pieces):
            return self._forward_media(pieces)
        rows = self._check(pieces)
        out = np.empty((rows, self.n_vocab), np.float32)
        first = list(itertools.accumulate((p.logits for p in pieces), initial=0))
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].slot)
        done = [0] * len(pieces)  # tokens of each piece evaluated so far
        with self._lock:
            base = {p.slot: self._n_past[p.slot] for p in pieces}  # where this call's cells begin
            shifted: dict[int, int] = {}
            try:
                while True:
                    parts: list[tuple[int, int, int]] = []  # (piece, first token, tokens)
                    room = self.max_batch
                    for i in order:
                        p = pieces[i]
                        k = min(len(p.tokens) - done[i], room, self._part_size(p.slot))
                        if k > 0:
                            parts.append((i, done[i], k))
                            room -= k
                    if not parts:
                        break
                    for i, _, k in parts:
                        slot = pieces[i].slot
                        gone = self._make_room(slot, k)
                        if gone:
                            shifted[slot] = shifted.get(slot, 0) + gone
                            keep = self._policy[slot].sinks or 0  # type: ignore[union-attr]
                            if base[slot] > keep:  # this call's cells moved down with the rest
                                base[slot] = max(base[slot] - gone, keep)
                    self._decode(pieces, parts, out, first)
                    for i, _, k in parts:
                        done[i] += k
            except BaseException:
                for slot, start in base.items():
                    self._lib.llama_memory_seq_rm(self._mem, slot, start, -1)
                    self._n_past[slot] = start
                raise
        return Forward(out, shifted)

    def _forward_media(self, pieces: Sequence[Piece]) -> Forward:
        """Pieces that hold images: one piece at a time, its text as a batch of tokens and each
        image through libmtmd's decoder of encoded images (in one batch where the model attends
        across an image both ways). No logits are given for an image's positions."""
        vision = self._vision
        assert vision is not None
        total = 0
        for p in pieces:
            if self._policy[p.slot] is not None:
                raise LocalLLMError("images cannot be combined with --streaming yet")
            total += p.logits
            vision.check(p.tokens, p.logits)
        out = np.empty((total, self.n_vocab), np.float32)
        base = {p.slot: self._n_past[p.slot] for p in pieces}
        row = 0
        try:
            for p in pieces:
                owed_from = len(p.tokens) - p.logits
                for a, b, key in vision.runs(p.tokens):
                    if key is None:
                        owed = max(0, b - max(a, owed_from))
                        got = self.forward([Piece(p.slot, p.tokens[a:b], owed)]).logits
                        out[row : row + owed] = got
                        row += owed
                        continue
                    with self._lock:
                        if self._n_past[p.slot] + (b - a) > self.n_ctx:
                            raise ContextOverflow(f"{self._n_past[p.slot] + (b - a)} positions do "
                                                  f"not fit the context of {self.n_ctx}")  # fmt: skip
                        mark = log_mark()
                        rc = vision.decode(self._ctx.ctx, key, self._n_past[p.slot], p.slot)
                        if rc != 0:
                            said = recent_errors(mark)
                            why = f": {_strip_prefix(said[-1])}" if said else ""
                            raise LocalLLMError(f"llama.cpp could not evaluate an image (returned {rc}{why})")
                        self._n_past[p.slot] += b - a
        except BaseException:
            with self._lock:
                for slot, start in base.items():
                    self._lib.llama_memory_seq_rm(self._mem, slot, start, -1)
                    self._n_past[slot] = start
            raise
        return Forward(out, {})

    def _check(self, pieces: Sequence[Piece]) -> int:
        """Refuse what cannot be evaluated, before anything is; the rows of logits asked for."""
        seen: set[int] = set()
        rows = 0
        for p in pieces:
            slot, n = p.slot, len(p.tokens)
            if not 0 <= slot < self.n_slots or slot in seen:
                raise LocalLLMError(f"bad slot {slot} in a forward pass (slots 0..{self.n_slots - 1}, "
                                    "one piece each)")  # fmt: skip
            seen.add(slot)
            if getattr(p, "parents", None) is not None:
                raise LocalLLMError("the llama.cpp backend verifies no draft trees")
            if not 0 <= p.logits <= n:
                raise LocalLLMError(f"a piece of {n} tokens cannot give {p.logits} rows of logits")
            rows += p.logits
            if n:
                ids = np.asarray(p.tokens)
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= self.n_vocab:
                    bad = lo if lo < 0 else hi
                    raise LocalLLMError(f"token {bad} is not in the model's vocabulary "
                                        f"(0..{self.n_vocab - 1})")  # fmt: skip
            if self._policy[slot] is None and self._n_past[slot] + n > self.n_ctx:
                raise ContextOverflow(
                    f"{self._n_past[slot] + n} tokens do not fit the context of {self.n_ctx}"
                )
        return rows

    def _part_size(self, slot: int) -> int:
        """The most tokens of a piece one decode takes: a batch, or under a StreamingLLM policy
        half its window (so a shift before each part keeps the recent half)."""
        policy = self._policy[slot]
        if policy is None:
            return self.max_batch
        keep = policy.sinks or 0
        room = min(self.n_ctx, keep + policy.window) - keep
        return max(1, min(self.max_batch, policy.window // 2, room))

    def _make_room(self, slot: int, need: int) -> int:
        """Before `need` more tokens: shift the slot's cells if its policy says so and it must
        (forget max(what does not fit, a quarter of the window) after the sinks); the positions
        forgotten."""
        policy = self._policy[slot]
        if policy is None:
            return 0
        keep = policy.sinks or 0
        capacity = min(self.n_ctx, keep + policy.window)
        n_past = self._n_past[slot]
        if n_past + need <= capacity:
            return 0
        discard = min(max(n_past + need - capacity, policy.step or policy.window // 4), n_past - keep)
        if discard <= 0 or n_past - discard + need > capacity:
            raise LocalLLMError(
                "the context cannot hold the sinks and one batch; use a larger --ctx"
            )
        lib = self._lib
        lib.llama_memory_seq_rm(self._mem, slot, keep, keep + discard)
        lib.llama_memory_seq_add(self._mem, slot, keep + discard, n_past, -discard)
        self._n_past[slot] = n_past - discard
        return discard

    def _decode(self, pieces: Sequence[Piece], parts: Sequence[tuple[int, int, int]],
                out: np.ndarray, first: Sequence[int]) -> None:  # fmt: skip
        """One `llama_decode` of `parts` (piece, first token, tokens), in slot order; the logits
        rows they owe go to `out` at their pieces' rows."""
        b = self._batch
        n = 0
        copies: list[tuple[int, int]] = []  # (row in `out`, rows): in batch order
        for i, a, k in parts:
            p = pieces[i]
            slot, pos = p.slot, self._n_past[p.slot]
            if k == 1:  # a decode step: scalar stores are several times cheaper than slices
                b.token[n], b.pos[n], b.seq_id[n], b.logits[n] = p.tokens[a], pos, slot, 0
            else:
                b.token[n : n + k] = p.tokens[a : a + k]
                b.pos[n : n + k] = np.arange(pos, pos + k)
                b.seq_id[n : n + k] = slot
                b.logits[n : n + k] = 0
            # logits for the piece's last `p.logits` tokens: those in this part
            lo = max(a, len(p.tokens) - p.logits)
            if lo < a + k:
                b.logits[n + lo - a : n + k] = 1
                copies.append((first[i] + lo - (len(p.tokens) - p.logits), a + k - lo))
            n += k
        mark = log_mark()
        rc = b.decode(self._ctx.ctx, n)
        if rc != 0:
            said = recent_errors(mark)
            why = f": {_strip_prefix(said[-1])}" if said else ""
            raise LocalLLMError(
                f"llama.cpp could not evaluate a batch of {n} tokens "
                f"(llama_decode returned {rc}{why})"
            )
        for i, _, k in parts:
            self._n_past[pieces[i].slot] += k
        if copies:
            n_out = sum(c for _, c in copies)
            ptr = self._lib.llama_get_logits(self._ctx.ctx)  # the flagged rows, in batch order
            if not ptr:
                raise LocalLLMError("llama.cpp gave no logits")
            got = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
            src = 0
            for dst, c in copies:
                out[dst : dst + c] = got[src : src + c]
                src += c

    # -- the slots' caches ---------------------------------------------------------------------

    def held(self, slot: int) -> int:
        return self._n_past[slot]

    def clear(self, slot: int, policy: ContextPolicy | None = None) -> None:
        """Empty the slot's cells; its next tokens follow `policy` (StreamingLLM or none)."""
        if policy is not None and not policy.enabled:
            policy = None
        if policy is not None:
            keep = policy.sinks or 0
            if min(self.n_ctx, keep + policy.window) - keep < 1:
                raise LocalLLMError(f"--streaming keeps {keep} sink tokens but the context holds "
                                    f"{self.n_ctx}; use a larger --ctx")  # fmt: skip
            if not self._lib.llama_memory_can_shift(self._mem):
                raise LocalLLMError("this model's cache cannot be shifted; use a larger --ctx "
                                    "instead of --streaming")  # fmt: skip
        with self._lock:
            self._lib.llama_memory_seq_rm(self._mem, slot, 0, -1)
            self._n_past[slot] = 0
            self._policy[slot] = policy

    def trim(self, slot: int, n: int, *, exact: bool = False,
             skip: frozenset[int] = frozenset()) -> bool:  # fmt: skip
        """Forget the slot's last `n` positions. llama.cpp removes cells exactly (what stays is
        what it was), so `exact` always holds, except for a model whose cache cannot remove a
        tail (recurrent): the slot is then cleared and False returned."""
        if skip:
            raise LocalLLMError(NO_LAYER_SKIP)
        with self._lock:
            held = self._n_past[slot]
            if not 0 <= n <= held:
                raise LocalLLMError(f"slot {slot} holds {held} positions: it cannot forget {n}")
            if n == 0:
                return True
            if self._lib.llama_memory_seq_rm(self._mem, slot, held - n, -1):
                self._n_past[slot] = held - n
                return True
            self._lib.llama_memory_seq_rm(self._mem, slot, 0, -1)
            self._n_past[slot] = 0
            return False

    # -- the prefix cache (`localllm.prefix_cache`): sequence states in host memory ------------

    def save(self, slot: int, start: int, end: int) -> _State | None:
        """The slot's cells [0, end) as llama.cpp saves a sequence (its whole state); None unless
        `end` is all it holds (a state cannot be cut)."""
        with self._lock:
            if end != self._n_past[slot] or end <= 0:
                return None
            lib, ctx = self._lib, self._ctx.ctx
            size = lib.llama_state_seq_get_size_ext(ctx, slot, 0)
            buf = (ctypes.c_uint8 * size)()
            n = lib.llama_state_seq_get_data_ext(ctx, buf, size, slot, 0)
            return _State(bytes(buf)[:n], end) if n else None

    def restore(self, slot: int, pieces: Sequence[tuple[Any, int]]) -> bool:
        """Load the last handle's state into the slot and keep its first n positions, n the
        tokens used from it (for "full" handles, the whole prefix). False (the slot cleared)
        when llama.cpp refuses the state."""
        with self._lock:
            lib = self._lib
            lib.llama_memory_seq_rm(self._mem, slot, 0, -1)
            self._n_past[slot] = 0
            if not pieces:
                return False
            state, n = pieces[-1]
            if not isinstance(state, _State) or not 0 < n <= state.end:
                return False
            buf = (ctypes.c_uint8 * len(state.data)).from_buffer_copy(state.data)
            if not lib.llama_state_seq_set_data_ext(self._ctx.ctx, buf, len(state.data), slot, 0):
                lib.llama_memory_seq_rm(self._mem, slot, 0, -1)
                return False
            if n < state.end and not lib.llama_memory_seq_rm(self._mem, slot, n, -1):
                lib.llama_memory_seq_rm(self._mem, slot, 0, -1)
                return False
            self._n_past[slot] = n
            return True

    def split(self, handle: Any, k: int) -> tuple[Any, Any]:
        raise LocalLLMError("llama.cpp's prefix handles are whole sequence states (prefix_kind "
                            "'full'): they are never split")  # fmt: skip

    def release(self, handle: Any) -> None:
        """Nothing to give back: a state is bytes in host memory, gone with its last reference."""

    # -- the rest ------------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes the slots' cells hold now, as llama.cpp would save them (K and V rows of every
        held position, in the cache's types). While a forward runs, the last answer."""
        if not self._lock.acquire(blocking=False):
            return self._kv_seen
        try:
            if self._ctx is not None:
                size = self._lib.llama_state_seq_get_size_ext
                self._kv_seen = sum(int(size(self._ctx.ctx, s, 0))
                                    for s in range(self.n_slots) if self._n_past[s])  # fmt: skip
            return self._kv_seen
        finally:
            self._lock.release()

    def kv_stats(self, slot: int) -> dict[str, float]:
        """Nothing llama.cpp tells cheaply (the engine estimates from the KV types)."""
        return {}

    def decode_weight_bytes(self) -> int | None:
        """Bytes of weights one decode step reads: not known here (the engine uses the file's)."""
        return None

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
        with self._embed_lock:
            if self._embedder is not None:
                self._embedder.close()
                self._embedder = None
        with self._lock:
            vision, self._vision = getattr(self, "_vision", None), None
            if vision is not None:
                vision.close()
            if self._ctx is not None:
                self._ctx.close()
                self._model.close()
                self._ctx = self._model = None


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


class _Image(NamedTuple):
    chunk: Any  # an mtmd_input_chunk of this runner's (owned: freed with the runner)
    embd: Any  # the projector's output for it: (n_tokens · n_embd) floats
    n_tokens: int


class _Vision:
    """A model's vision projector through libmtmd (llama.cpp's multimodal library): images in,
    positions of encoded image embeddings out. Each distinct image (by its bytes' sha256) is
    encoded once and keeps its key, so its media ids are the same in every prompt (the prefix
    cache and slot reuse see the same image as the same tokens); the encodings of the
    `KEEP` images used last are held."""

    KEEP = 32  # encoded images held (a Gemma 3 image: 256 positions · 640 floats = 0.6 MiB)
    MAX_SIDE = 8192  # pixels: a larger image is refused before it is decoded

    def __init__(self, lib: Any, model: Any, path: str, n_threads: int, *, gpu: bool,
                 max_batch: int) -> None:  # fmt: skip
        import llama_cpp.mtmd_cpp as mtmd

        self._m, self._lib = mtmd, lib
        with _log_lock:  # libmtmd's log (and its helpers') into the store's log, as llama.cpp's
            callback = _log_state.get("callback")
            if callback is not None and "mtmd" not in _log_state:
                mtmd.mtmd_log_set(callback, ctypes.c_void_p(0))
                mtmd.mtmd_helper_log_set(callback, ctypes.c_void_p(0))
                _log_state["mtmd"] = True
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        params.media_marker = MEDIA_MARKER.encode()
        mark = log_mark()
        self._ctx = mtmd.mtmd_init_from_file(path.encode(), model, params)
        if not self._ctx:
            said = recent_errors(mark)
            why = f": {_strip_prefix(said[-1])}" if said else ""
            raise LocalLLMError(f"llama.cpp cannot load the vision projector {Path(path).name}{why}")
        if not mtmd.mtmd_support_vision(self._ctx):
            self.close()
            raise LocalLLMError(f"{Path(path).name} is not a vision projector (it reads no images)")
        if mtmd.mtmd_decode_use_mrope(self._ctx):
            self.close()
            raise LocalLLMError("this model places image positions in two dimensions (M-RoPE): "
                                "not supported yet")  # fmt: skip
        self._n_embd = int(lib.llama_model_n_embd_inp(model))
        self._max_batch = max_batch
        self._keys: dict[str, int] = {}  # sha256 of an image's bytes -> its key
        self._images: collections.OrderedDict[int, _Image] = collections.OrderedDict()

    def tokenize(self, text: str, images: Sequence[bytes], *, add_special: bool) -> list[int]:
        import hashlib

        m = self._m
        if text.count(MEDIA_MARKER) != len(images):
            raise LocalLLMError(f"the prompt places {text.count(MEDIA_MARKER)} images but "
                                f"{len(images)} were given")  # fmt: skip
        bitmaps, digests = [], []
        chunks = m.mtmd_input_chunks_init()
        try:
            for data in images:
                check_image(data, self.MAX_SIDE)
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = m.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
                if not bitmap:
                    raise LocalLLMError("an image could not be decoded (a PNG, JPEG, GIF or BMP file "
                                        "is expected)")  # fmt: skip
                bitmaps.append(bitmap)
                digests.append(hashlib.sha256(data).hexdigest())
            raw = text.encode("utf-8")
            given = m.mtmd_input_text(raw, len(raw), add_special, True)
            array = (m.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = m.mtmd_tokenize(self._ctx, chunks, ctypes.byref(given), array, len(bitmaps))
            if rc != 0:
                raise LocalLLMError(f"llama.cpp could not read the prompt's images (mtmd_tokenize returned {rc})")
            ids: list[int] = []
            seen = 0
            for i in range(m.mtmd_input_chunks_size(chunks)):
                chunk = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(chunk) == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    toks = m.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    ids += [int(toks[j]) for j in range(n.value)]
                    continue
                if m.mtmd_input_chunk_get_type(chunk) != m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    raise LocalLLMError("only images are read here (not audio)")
                key = self._encoded(chunk, digests[seen])
                seen += 1
                ids += [media_id(key, j) for j in range(self._images[key].n_tokens)]
            return ids
        finally:
            m.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                m.mtmd_bitmap_free(bitmap)

    def _encoded(self, chunk: Any, digest: str) -> int:
        """The key of this image, encoding it unless its encoding is held."""
        m = self._m
        key = self._keys.setdefault(digest, len(self._keys))
        if key in self._images:
            self._images.move_to_end(key)
            return key
        n_tokens = int(m.mtmd_input_chunk_get_n_tokens(chunk))
        if n_tokens > MEDIA_SPAN or (n_tokens > self._max_batch and m.mtmd_decode_use_non_causal(self._ctx, chunk)):
            raise LocalLLMError(f"an image takes {n_tokens} positions here; one batch holds {self._max_batch}")
        if m.mtmd_encode_chunk(self._ctx, chunk) != 0:
            raise LocalLLMError("the vision projector could not encode an image")
        size = n_tokens * self._n_embd
        embd = (ctypes.c_float * size)()
        ctypes.memmove(embd, m.mtmd_get_output_embd(self._ctx), size * ctypes.sizeof(ctypes.c_float))
        self._images[key] = _Image(m.mtmd_input_chunk_copy(chunk), embd, n_tokens)
        while len(self._images) > self.KEEP:
            _, old = self._images.popitem(last=False)
            m.mtmd_input_chunk_free(old.chunk)
        return key

    def runs(self, tokens: Sequence[int]) -> Iterator[tuple[int, int, int | None]]:
        """(start, end, image key or None for text) of each run of `tokens`."""
        start = 0
        while start < len(tokens):
            got = media_of(tokens[start])
            end = start + 1
            if got is None:
                while end < len(tokens) and tokens[end] >= 0:
                    end += 1
                yield start, end, None
            else:
                end = start + self._images[got[0]].n_tokens
                yield start, end, got[0]
            start = end

    def check(self, tokens: Sequence[int], logits: int) -> None:
        """Every image in `tokens` whole, known, and asked for no logits."""
        i = 0
        while i < len(tokens):
            got = media_of(tokens[i])
            if got is None:
                i += 1
                continue
            key, offset = got
            image = self._images.get(key)
            if image is None:
                raise LocalLLMError("an image of this prompt is no longer held; send the request again")
            whole = [media_id(key, j) for j in range(image.n_tokens)]
            if offset or list(tokens[i : i + image.n_tokens]) != whole:
                raise LocalLLMError("an image was split across forward passes (evaluate it whole)")
            i += image.n_tokens
            if i > len(tokens) - logits:
                raise LocalLLMError("no logits are given for an image's positions")

    def decode(self, ctx: Any, key: int, n_past: int, seq: int) -> int:
        image = self._images[key]
        self._images.move_to_end(key)
        new = self._lib.llama_pos(0)
        no_callback = self._m.mtmd_helper_post_decode_callback()  # a NULL function pointer
        return int(self._m.mtmd_helper_decode_image_chunk(self._ctx, ctx, image.chunk, image.embd, n_past, seq,
                                                          self._max_batch, ctypes.byref(new), no_callback, None))  # fmt: skip

    def close(self) -> None:
        for image in self._images.values():
            self._m.mtmd_input_chunk_free(image.chunk)
        self._images.clear()
        if self._ctx:
            self._m.mtmd_free(self._ctx)
            self._ctx = None


IMAGE_KINDS = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg", b"GIF87a": "gif", b"GIF89a": "gif", b"BM": "bmp"}


def check_image(data: bytes, max_side: int) -> None:
    """A PNG, JPEG, GIF or BMP (what libmtmd decodes) no larger than `max_side` a side, by its
    header: a hostile file is refused before a decoder allocates for it."""
    kind = next((k for magic, k in IMAGE_KINDS.items() if data.startswith(magic)), None)
    if kind is None:
        raise LocalLLMError("an image must be a PNG, JPEG, GIF or BMP file")
    size = _image_size(data, kind)
    if size is None:
        raise LocalLLMError(f"the {kind.upper()} image is damaged (its size cannot be read)")
    w, h = size
    if not (0 < w <= max_side and 0 < h <= max_side):
        raise LocalLLMError(f"the image is {w}x{h} pixels; at most {max_side} a side is read")


def _image_size(data: bytes, kind: str) -> tuple[int, int] | None:
    import struct

    try:
        if kind == "png":
            return struct.unpack(">II", data[16:24])
        if kind == "gif":
            return struct.unpack("<HH", data[6:10])
        if kind == "bmp":
            w, h = struct.unpack("<ii", data[18:26])
            return w, abs(h)
        i = 2  # JPEG: walk the segments to a start-of-frame
        while i + 9 < len(data):
            if data[i] != 0xFF:
                return None
            marker = data[i + 1]
            length = struct.unpack(">H", data[i + 2 : i + 4])[0]
            if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return w, h
            i += 2 + length
    except struct.error:
        return None
    return None
