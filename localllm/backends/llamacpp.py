"""The llama.cpp backend, through llama-cpp-python.

`Llama` loads the model and context and evaluates batches; sampling is our own llama.cpp sampler
chain (the C API, same samplers and order as llama-cpp-python uses), so the decode loop is ours:
cancellation every token, and the StreamingLLM-style context shift when the cache fills.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from threading import Event
from typing import Any

from localllm.backends import LLAMACPP as CAPABILITIES
from localllm.backends import LLAMACPP_KV_TYPES
from localllm.backends.base import Step
from localllm.chat import template_for
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.memory import parse_kv_cache
from localllm.types import ContextPolicy, SamplingParams

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
    check_load(path, digest, name, n_gpu_layers=n_gpu_layers, home=home)
    return LlamaCppBackend(path, n_ctx=options.ctx, kv_cache=options.kv_cache,
                           n_threads=options.threads, n_gpu_layers=n_gpu_layers)  # fmt: skip


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


class LlamaCppBackend:
    name = "llama.cpp"
    capabilities = CAPABILITIES

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int,
        kv_cache: str = "f16",
        n_threads: int | None = None,
        n_gpu_layers: int = -1,
        flash_attn: bool | None = None,
        seed: int | None = None,
    ) -> None:
        llama_cpp = quiet_llama_log()
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
            # with flash attention a batch and token-by-token evaluation agree exactly.
            flash_attn = True
        mark = log_mark()
        try:
            with templates_not_compiled():
                self.llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=n_ctx,
                    n_batch=min(512, n_ctx),
                    n_threads=n_threads or default_threads(),
                    n_gpu_layers=n_gpu_layers,
                    flash_attn=bool(flash_attn),
                    type_k=_GGML_TYPE[type_k],
                    type_v=_GGML_TYPE[type_v],
                    seed=seed if seed is not None else llama_cpp.LLAMA_DEFAULT_SEED,
                    chat_handler=_TemplateNotCompiled("").to_chat_handler(),
                    verbose=False,
                )
        except (ValueError, RuntimeError) as e:  # llama-cpp-python's words hide llama.cpp's reason
            said = [ln for ln in recent_errors(mark) if "error" in ln.lower()] or recent_errors(mark)
            reason = said[-1] if said else str(e).split(":")[0]
            raise LocalLLMError(f"llama.cpp cannot load it: {_strip_prefix(reason)}") from None
        self.n_ctx = self.llm.n_ctx()
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._embedder = None
        self._embed_lock = threading.Lock()
        meta = self.llm.metadata
        bos, eos = self.llm.token_bos(), self.llm.token_eos()
        self.chat_template = template_for(
            meta,
            bos_token=self._piece(bos) if bos >= 0 else "",
            eos_token=self._piece(eos) if eos >= 0 else "",
        )
        self.has_template = "tokenizer.chat_template" in meta

    # -- tokens --------------------------------------------------------------------------------

    def _piece(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

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
        return self.llm.detokenize(list(tokens)).decode("utf-8", "replace")

    def is_end(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def bos_text(self) -> str:
        return self.chat_template.bos_token

    # -- generation ----------------------------------------------------------------------------

    def _sampler(self, s: SamplingParams):  # noqa: ANN202
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lambda smpl: lib.llama_sampler_chain_add(chain, smpl)  # noqa: E731
        if s.repeat_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
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

    def _reuse_prefix(self, ids: Sequence[int]) -> int:
        """Keep the cached prefix shared with the new prompt; drop the rest of the cache."""
        llm = self.llm
        n = 0
        limit = min(llm.n_tokens, len(ids) - 1)  # always evaluate at least one token for logits
        cached = llm.input_ids
        while n < limit and cached[n] == ids[n]:
            n += 1
        llm.n_tokens = n
        return n

    def _shift(self, policy: ContextPolicy, need: int) -> int:
        """Drop the oldest tokens after the sinks so `need` more fit; returns how many went."""
        llm = self.llm
        lib = self._lib
        keep = policy.sinks or 0
        capacity = min(self.n_ctx, keep + policy.window)
        n_past = llm.n_tokens
        if n_past + need <= capacity:
            return 0
        discard = max(n_past + need - capacity, policy.window // 4)
        discard = min(discard, n_past - keep)
        if discard <= 0:
            raise LocalLLMError(
                "the context cannot hold the sinks and one batch; use a larger --ctx"
            )
        mem = lib.llama_get_memory(llm.ctx)
        if not lib.llama_memory_can_shift(mem):
            raise LocalLLMError("this model's cache cannot be shifted; use a larger --ctx instead")
        lib.llama_memory_seq_rm(mem, 0, keep, keep + discard)
        lib.llama_memory_seq_add(mem, 0, keep + discard, n_past, -discard)
        ids = llm.input_ids
        ids[keep : n_past - discard] = ids[keep + discard : n_past].copy()
        llm.n_tokens = n_past - discard
        return discard

    def _eval(self, tokens: Sequence[int], policy: ContextPolicy, shifted: list[int]) -> None:
        """Evaluate `tokens`, shifting the cache between batches when the policy allows."""
        step = self.llm.n_batch
        if policy.enabled:
            step = max(1, min(step, policy.window // 2))
        for i in range(0, len(tokens), step):
            batch = tokens[i : i + step]
            if policy.enabled:
                gone = self._shift(policy, len(batch))
                if gone:
                    shifted.append(gone)
            self.llm.eval(batch)

    def steps(
        self, ids: Sequence[int], sampling: SamplingParams, policy: ContextPolicy, cancel: Event
    ) -> Iterator[Step]:
        """Process the prompt, then yield one sampled token at a time until the caller stops."""
        lib = self._lib
        cached = self._reuse_prefix(ids)
        shifted: list[int] = []
        chain = self._sampler(sampling)
        try:
            self._eval(ids[cached:], policy, shifted)
            first = True
            while not cancel.is_set():
                token = lib.llama_sampler_sample(chain, self.llm.ctx, -1)
                logprob, top = (
                    self._logprobs(token, sampling.logprobs)
                    if sampling.logprobs is not None
                    else (None, ())
                )
                yield Step(
                    token,
                    cached=cached if first else 0,
                    shifted=tuple(shifted),
                    logprob=logprob,
                    top=top,
                )
                first = False
                shifted = []
                if not policy.enabled and self.llm.n_tokens + 1 > self.n_ctx:
                    return  # the engine reports `length`; it never asks past the context
                self._eval([token], policy, shifted)
        finally:
            lib.llama_sampler_free(chain)

    def _logprobs(self, token: int, n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        import numpy as np

        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).astype(np.float64)
        m = logits.max()
        logz = m + math.log(float(np.exp(logits - m).sum()))
        top = np.argsort(-logits)[:n_top] if n_top else []
        return float(logits[token] - logz), tuple((int(i), float(logits[i] - logz)) for i in top)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalised embeddings from a second context made for embedding."""
        with self._embed_lock:
            if self._embedder is None:
                with templates_not_compiled():
                    self._embedder = self._lib.Llama(
                        model_path=self.llm.model_path, n_ctx=self.n_ctx, n_batch=self.n_ctx,
                        n_ubatch=self.n_ctx, n_threads=self.llm.n_threads, embedding=True,
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
        self.llm.close()
