"""The engine: turns a `Request` into a stream of `Chunk`s on one worker thread per loaded model.

    front door ──submit(Request)──▶ queue ──▶ worker thread ──▶ backend.steps() (tokens)
         ◀──────── Chunk … Chunk(result=Result) ◀── detokenize, stop strings, limits, tool calls

Front doors only submit and consume; cancellation is a flag the worker checks every token. What
is shared by every backend (prompt rendering, honest context checks, UTF-8-safe incremental text,
stop strings, finish reasons, timings) lives here, once.
"""

from __future__ import annotations

import codecs
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from localllm.backends.base import Backend
from localllm.chat import parse_tool_calls
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.types import (
    Chunk,
    ContextPolicy,
    FinishReason,
    Message,
    Request,
    Result,
    SamplingParams,
    Timings,
    TokenLogprob,
    Usage,
)


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def prompt_ids(backend: Backend, request: Request) -> list[int]:
    """Render (chat) or take (raw) the prompt and tokenize it."""
    if request.messages is not None:
        text = backend.chat_template.render(request.messages, tools=request.tools)
        bos = backend.bos_text()
        add_special = not (bos and text.startswith(bos))  # the template wrote BOS itself
    else:
        text, add_special = request.prompt or "", True
    ids = backend.tokenize(text, add_special=add_special)
    if not ids:
        raise LocalLLMError("the prompt is empty")
    return ids


def check_context(
    n_prompt: int, n_ctx: int, sampling: SamplingParams, policy: ContextPolicy
) -> None:
    """Never truncate silently: refuse with the numbers unless a shifting policy was chosen."""
    hint = "use a larger --ctx, a shorter prompt, or --streaming SINKS:WINDOW to shift the context"
    if policy.enabled:
        if (policy.sinks or 0) + 1 >= n_ctx:
            raise ContextOverflow(
                f"--streaming keeps {policy.sinks} sink tokens but the context holds {n_ctx}"
            )
        return
    if n_prompt >= n_ctx:
        raise ContextOverflow(
            f"the prompt has {n_prompt} tokens but the context holds {n_ctx}; {hint}"
        )
    if sampling.max_tokens and n_prompt + sampling.max_tokens > n_ctx:
        raise ContextOverflow(
            f"prompt ({n_prompt} tokens) + max_tokens ({sampling.max_tokens}) = "
            f"{n_prompt + sampling.max_tokens} exceeds the context of {n_ctx}; {hint}"
        )


def generate(
    backend: Backend,
    request: Request,
    cancel: threading.Event,
    *,
    submitted: float,
    load_s: float = 0.0,
) -> Iterator[Chunk]:
    """Run one request to its end. The last chunk carries the Result."""
    s, policy = request.sampling, request.context
    if policy.enabled and not backend.capabilities.streaming:
        raise LocalLLMError(f"the {backend.name} backend cannot shift its context (--streaming)")
    ids = prompt_ids(backend, request)
    check_context(len(ids), backend.n_ctx, s, policy)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    stops = StopMatcher(s.stop)
    out: list[int] = []
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    cached = shifts = discarded = 0
    finish: FinishReason = "length"
    stop_hit = False
    t_start = time.perf_counter()
    t_first = t_last = 0.0
    if s.max_tokens != 0:
        for i, step in enumerate(backend.steps(ids, s, policy, cancel)):
            t_last = time.perf_counter()
            if i == 0:
                t_first, cached = t_last, step.cached
            shifts += len(step.shifted)
            discarded += sum(step.shifted)
            if backend.is_end(step.token):
                finish = "stop"
                break
            out.append(step.token)
            piece = decoder.decode(backend.token_bytes(step.token))
            lp: tuple[TokenLogprob, ...] = ()
            if step.logprob is not None:
                lp = (TokenLogprob(piece, step.token, step.logprob,
                                   tuple((backend.detokenize([t]), v) for t, v in step.top)),)  # fmt: skip
                logprobs.extend(lp)
            text, hit = stops.feed(piece)
            if text or lp:
                texts.append(text)
                yield Chunk(text, (step.token,), lp)
            if hit:
                finish, stop_hit = "stop", True
                break
            if s.max_tokens and len(out) >= s.max_tokens:
                break
            if not policy.enabled and len(ids) + len(out) >= backend.n_ctx:
                break  # the context is full: `length`, said in the result, never silent
            if cancel.is_set():
                finish = "cancelled"
                break
        else:
            finish = "cancelled" if cancel.is_set() else "length"
    # text held back as a possible stop-string prefix belongs to the answer unless a stop string hit
    tail = "" if stop_hit else stops.flush() + decoder.decode(b"", final=True)
    texts.append(tail)
    text = "".join(texts)
    tool_calls: tuple = ()
    if request.tools and finish == "stop":
        content, calls = parse_tool_calls(text)
        if calls:
            text, tool_calls, finish = content, tuple(calls), "tool_calls"
    now = time.perf_counter()
    timings = Timings(
        load_s=load_s,
        prompt_s=(t_first - t_start) if t_first else 0.0,
        ttft_s=(t_first - submitted) if t_first else 0.0,
        decode_s=(t_last - t_first) if t_first else 0.0,
        total_s=now - submitted,
    )
    usage = Usage(prompt_tokens=len(ids), completion_tokens=len(out), cached_tokens=cached)
    result = Result(
        text=text, token_ids=tuple(out), finish_reason=finish, usage=usage, timings=timings,
        tool_calls=tool_calls, context_shifts=shifts, discarded_tokens=discarded,
        logprobs=tuple(logprobs) if s.logprobs is not None else None,
    )  # fmt: skip
    yield Chunk(tail, (), result=result)


_END = object()


@dataclass
class _Job:
    request: Request
    submitted: float
    cancel: threading.Event = field(default_factory=threading.Event)
    out: queue.Queue = field(default_factory=queue.Queue)


class Stream:
    """The chunks of one submitted request. Iterate it; `cancel()` stops generation within a token."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.result: Result | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        item = self._job.out.get()
        if item is _END:
            self._job.out.put(_END)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            self._job.out.put(_END)
            raise item
        if item.result is not None:
            self.result = item.result
        return item

    def cancel(self) -> None:
        self._job.cancel.set()

    def wait(self) -> Result:
        """Consume the rest of the stream and return its Result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        """Stop generating (if still running) and drain."""
        self.cancel()
        for _ in self:
            pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Model:
    """A loaded model: one backend, one worker thread, a queue. The Python API's `llm`."""

    def __init__(self, backend: Backend, name: str, *, load_s: float = 0.0,
                 context: ContextPolicy | None = None) -> None:  # fmt: skip
        self.backend = backend
        self.name = name
        self.load_s = load_s
        self.context = context or ContextPolicy()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"localllm:{name}", daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def capabilities(self):  # noqa: ANN201
        return self.backend.capabilities

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    def _work(self) -> None:
        first = True
        while (job := self._queue.get()) is not None:
            try:
                for chunk in generate(self.backend, job.request, job.cancel, submitted=job.submitted,
                                      load_s=self.load_s if first else 0.0):  # fmt: skip
                    job.out.put(chunk)
                first = False
            except LocalLLMError as e:
                job.out.put(e)
            except Exception as e:  # noqa: BLE001 - reported to the consumer as one line
                job.out.put(LocalLLMError(f"generation failed: {type(e).__name__}: {e}"))
            finally:
                job.out.put(_END)

    def submit(self, request: Request) -> Stream:
        if self._closed:
            raise LocalLLMError("the model is closed")
        if request.context == ContextPolicy() and self.context.enabled:
            from dataclasses import replace

            request = replace(request, context=self.context)
        job = _Job(request, time.perf_counter())
        self._queue.put(job)
        return Stream(job)

    # -- the Python API (PRODUCT.md) -----------------------------------------------------------

    def _request(self, prompt: str | Sequence[Message], **kw: Any) -> Request:
        tools = kw.pop("tools", ())
        tool_choice = kw.pop("tool_choice", None)
        sampling = SamplingParams.from_kwargs(**kw)
        if isinstance(prompt, str):
            return Request(prompt=prompt, sampling=sampling)
        return Request(
            messages=tuple(prompt), tools=tuple(tools), tool_choice=tool_choice, sampling=sampling
        )

    def stream(self, prompt: str | Sequence[Message], **kw: Any) -> Iterator[Chunk]:
        """A string is a raw completion; a list of messages goes through the chat template."""
        with self.submit(self._request(prompt, **kw)) as s:
            yield from s

    def complete(self, prompt: str, **kw: Any) -> Result:
        return self.submit(self._request(prompt, **kw)).wait()

    def chat(self, messages: Sequence[Message], **kw: Any) -> Result:
        return self.submit(self._request(list(messages), **kw)).wait()

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.backend.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.backend.detokenize(tokens)

    def embed(self, texts: str | Sequence[str]) -> list[list[float]]:
        """One normalised vector per text (a separate context: generation is not disturbed)."""
        if not self.capabilities.embeddings:
            raise LocalLLMError(f"the {self.backend.name} backend has no embeddings")
        return self.backend.embed([texts] if isinstance(texts, str) else list(texts))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            self.backend.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BACKENDS = ("auto", "llama.cpp", "torch")


def load(
    model: str,
    *,
    backend: str = "auto",
    device: str = "auto",
    ctx: int | None = None,
    kv_cache: str = "f16",
    streaming: str | tuple[int, int] | None = None,
    speculative: str | None = None,
    n_threads: int | None = None,
    check_memory: bool = True,
) -> Model:
    """Load a model by name (registering the offline default on first use) and start its worker."""
    from localllm.errors import DoesNotFit
    from localllm.memory import estimate, resolve_ctx
    from localllm.model_info import human_bytes
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    if backend not in BACKENDS:
        raise LocalLLMError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if device not in ("auto", "cpu", "cuda", "mps"):
        raise LocalLLMError(f"unknown device {device!r} (auto, cpu, cuda, mps)")
    if backend == "torch":
        raise LocalLLMError(
            "the torch backend is not part of this build yet; use --backend llama.cpp"
        )
    policy = ContextPolicy.parse(streaming)
    if speculative not in (None, "off"):
        raise LocalLLMError(
            f"the llama.cpp backend has no speculative mode {speculative!r} (it has: off)"
        )
    store = Store()
    record = ensure_local(model, store)
    n_ctx = resolve_ctx(record.info, ctx)
    if check_memory:
        est = estimate(
            record.info, ctx=n_ctx, kv_cache=kv_cache, device="cpu" if device == "cpu" else "auto"
        )
        if not est.fits:
            raise DoesNotFit(
                f"{record.name} at context {n_ctx} needs {human_bytes(est.total_bytes)} "
                f"(weights {human_bytes(est.weights_bytes)}, KV {human_bytes(est.kv_bytes)}, "
                f"compute {human_bytes(est.compute_bytes)}) but {human_bytes(est.available_bytes)} "
                f"is free on {est.device}; try a smaller --ctx or --kv-cache q8_0"
            )
    choose_backend(backend)
    from localllm.backends.llamacpp import LlamaCppBackend
    from localllm.backends.llamacpp_guard import check_load

    path = store.path_of(record)
    n_gpu_layers = 0 if device == "cpu" else -1
    t0 = time.perf_counter()
    # the first load of a file runs in a child: a file llama.cpp would abort on is refused here
    check_load(path, record.digest, record.name, n_gpu_layers=n_gpu_layers, home=store.home)
    try:
        b = LlamaCppBackend(path, n_ctx=n_ctx, kv_cache=kv_cache, n_threads=n_threads,
                            n_gpu_layers=n_gpu_layers)  # fmt: skip
    except LocalLLMError as e:
        raise LocalLLMError(f"{record.name}: {e}") from None
    return Model(b, record.name, load_s=time.perf_counter() - t0, context=policy)


def choose_backend(backend: str = "auto") -> str:
    """The backend a load will use, or `BackendUnavailable` saying why none can run here.

    llama.cpp is probed once per build and machine (in a child: a build that dies on this CPU
    becomes one line, not a signal). `auto` would move on to the next backend; the torch engine
    is the next one, and it is not part of this build yet.
    """
    from localllm.backends.llamacpp_guard import probe
    from localllm.errors import BackendUnavailable

    verdict = probe()
    if verdict.ok:
        return "llama.cpp"
    also = " (and no other backend is installed)" if backend == "auto" else ""
    raise BackendUnavailable(f"llama.cpp cannot run on this machine{also}: {verdict.message()}")
