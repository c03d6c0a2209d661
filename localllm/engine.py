"""The engine: sequences in slots, one scheduler thread per loaded model, one output assembler.

    front doors ──submit(Request)──▶ queue ──▶ scheduler thread ──▶ backend.step(plan)
          ◀──── Chunk … Chunk(result=Result) ◀── Assembler (UTF-8, stop strings, limits, tools)

Front doors only submit and consume. The scheduler admits waiting requests into free slots between
steps, evaluates new prompts in bounded chunks beside the decode steps of running sequences (so a
long prompt does not stall the others), and checks every sequence's cancel flag before each step.
What every backend shares — prompt rendering, honest context checks, refusing what a backend cannot
do, UTF-8-safe incremental text, stop strings, finish reasons, timings — lives here, once.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from localllm.backends import Capabilities
from localllm.backends.base import Backend, OneSlot, Seq, Step
from localllm.chat import parse_tool_calls
from localllm.errors import ContextOverflow, LocalLLMError, Unsupported
from localllm.prefix_cache import RadixCache
from localllm.types import (
    Chunk,
    ContextPolicy,
    FinishReason,
    LoadOptions,
    Message,
    Request,
    Result,
    SamplingParams,
    SpeculativeStats,
    Timings,
    TokenLogprob,
    Usage,
    speculative_mode,
)

# -- refuse, never ignore ------------------------------------------------------------------------


def check_options(options: LoadOptions, caps: Capabilities, backend: str) -> None:
    """Every load option the backend lacks is one `Unsupported` line, before anything loads."""
    from localllm import backends
    from localllm.memory import parse_kv_cache

    def no(what: str, has: Sequence[str] | None = None,
           elsewhere: Callable[[Capabilities], bool] | None = None) -> Unsupported:  # fmt: skip
        tail = f" (it has: {', '.join(has)})" if has else ""
        others = [s.name for s in backends.specs()
                  if elsewhere is not None and s.name != backend and elsewhere(s.capabilities)]  # fmt: skip
        if others:
            tail += f"; the {others[0]} backend has it (--backend {others[0]})"
        return Unsupported(f"the {backend} backend has no {what}{tail}")

    for t in dict.fromkeys(parse_kv_cache(options.kv_cache)):
        if t not in caps.kv_cache_types:
            raise no(f"{t} KV cache", caps.kv_cache_types, lambda c, t=t: t in c.kv_cache_types)  # type: ignore[misc]
    if options.streaming and not caps.streaming:
        raise no("context shift (--streaming)", None, lambda c: c.streaming)
    if options.evict:
        kind = options.evict.partition(":")[0]
        if kind not in caps.eviction:
            raise no(f"{kind} eviction (--evict)", caps.eviction or ("none",),
                     lambda c: kind in c.eviction)  # fmt: skip
    mode = speculative_mode(options.speculative)
    if mode not in caps.speculative:
        raise no(f"speculative mode {mode!r}", caps.speculative, lambda c: mode in c.speculative)
    if options.device not in ("auto", *caps.devices):
        raise no(f"{options.device} device", caps.devices)
    if options.dtype not in ("auto", *caps.dtypes):
        raise no(f"{options.dtype} working dtype", caps.dtypes)


def check_supported(request: Request, caps: Capabilities, backend: str) -> None:
    """Every request field the backend lacks is one `Unsupported` line, never silently ignored."""
    rf = request.response_format
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise Unsupported(f"response_format type {kind!r} is not one of text, json_object, json_schema")
        if kind != "text" and not caps.grammar:
            raise Unsupported(
                f"the {backend} backend has no constrained decoding, so no response_format {kind}"
            )
    tc = request.tool_choice
    if tc not in (None, "auto", "none"):
        if tc != "required" and not (isinstance(tc, dict) and tc.get("type") == "function"):
            raise Unsupported(f"tool_choice {tc!r} is not auto, none, required or a function")
        if not caps.grammar:
            raise Unsupported(
                f"the {backend} backend has no constrained decoding, so tool_choice can only be "
                "auto or none"
            )
        if not request.tools:
            raise Unsupported("tool_choice names tools but the request has none")
    mode = speculative_mode(request.speculative)
    if mode not in caps.speculative:
        raise Unsupported(
            f"the {backend} backend has no speculative mode {mode!r} (it has: {', '.join(caps.speculative)})"
        )
    if request.context.enabled and not caps.streaming:
        raise Unsupported(f"the {backend} backend cannot shift its context (--streaming)")


# -- prompts and context -------------------------------------------------------------------------


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


# -- one sequence's output ------------------------------------------------------------------------


class Assembler:
    """Turns one sequence's `Step`s into `Chunk`s and its `Result`: the same for every backend.

    UTF-8 pieces are decoded incrementally, stop strings are found across chunk borders (text that
    could begin one is held back), limits end the sequence, and every generated token appears in
    exactly one chunk's `token_ids` (tokens whose text is held back ride with a later chunk).
    """

    def __init__(self, backend: Any, request: Request, n_prompt: int, *, submitted: float,
                 load_s: float = 0.0) -> None:  # fmt: skip
        self.backend = backend
        self.request = request
        self.n_prompt = n_prompt
        self.submitted = submitted
        self.load_s = load_s
        self.t_start = time.perf_counter()
        self.t_first = self.t_last = 0.0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stops = StopMatcher(request.sampling.stop)
        self.out: list[int] = []
        self.pending: list[int] = []  # tokens not yet handed out in a chunk
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.cached = self.shifts = self.discarded = 0
        self.finish_reason: FinishReason | None = None
        self.stop_hit = False
        # speculative decoding: what the decode passes did (`SpeculativeStats`' fields)
        self.spec = dict.fromkeys(("drafted", "accepted", "passes", "rounds", "rejections", "tokens"), 0)
        self.spec_off = ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, step: Step) -> Chunk | None:
        """Take one token; returns a chunk to hand out (or None). Sets `finish_reason` when done."""
        s, b = self.request.sampling, self.backend
        self.t_last = time.perf_counter()
        if not self.t_first:
            self.t_first = self.t_last
            self.cached = max(self.cached, step.cached)
        else:  # a token of a decode pass
            sp = self.spec
            sp["tokens"] += 1
            sp["passes"] += step.passes
            sp["drafted"] += step.drafted
            sp["accepted"] += step.accepted
            sp["rounds"] += bool(step.drafted)
            sp["rejections"] += step.accepted < step.drafted
            self.spec_off = self.spec_off or step.spec_off
        self.shifts += len(step.shifted)
        self.discarded += sum(step.shifted)
        if b.is_end(step.token) and not s.ignore_eos:
            self.finish_reason = "stop"
            return None
        self.out.append(step.token)
        self.pending.append(step.token)
        piece = self.decoder.decode(b.token_bytes(step.token))
        lp: tuple[TokenLogprob, ...] = ()
        if step.logprob is not None and s.logprobs is not None:
            lp = (TokenLogprob(piece, step.token, step.logprob,
                               tuple((b.detokenize([t]), v) for t, v in step.top)),)  # fmt: skip
            self.logprobs.extend(lp)
        text, hit = self.stops.feed(piece)
        chunk = None
        if text or lp:
            self.texts.append(text)
            chunk = Chunk(text, tuple(self.pending), lp)
            self.pending = []
        if hit:
            self.finish_reason, self.stop_hit = "stop", True
        elif s.max_tokens and len(self.out) >= s.max_tokens:
            self.finish_reason = "length"
        elif not self.request.context.enabled and self.n_prompt + len(self.out) >= b.n_ctx:
            self.finish_reason = "length"  # the context is full: said in the result, never silent
        return chunk

    def finish(self, reason: FinishReason | None = None, error: str | None = None) -> Chunk:
        """The last chunk: the rest of the text, the remaining tokens and the `Result`."""
        finish: FinishReason = "error" if error else reason or self.finish_reason or "length"
        # text held back as a possible stop-string prefix belongs to the answer unless one hit
        tail = "" if self.stop_hit else self.stops.flush() + self.decoder.decode(b"", final=True)
        self.texts.append(tail)
        text = "".join(self.texts)
        tool_calls: tuple = ()
        if self.request.tools and self.request.tool_choice != "none" and finish == "stop":
            content, calls = parse_tool_calls(text)
            if calls:
                text, tool_calls, finish = content, tuple(calls), "tool_calls"
        now = time.perf_counter()
        t_first, t_last = self.t_first, self.t_last
        timings = Timings(
            load_s=self.load_s,
            prompt_s=(t_first - self.t_start) if t_first else 0.0,
            ttft_s=(t_first - self.submitted) if t_first else 0.0,
            decode_s=(t_last - t_first) if t_first else 0.0,
            total_s=now - self.submitted,
        )
        n = len(self.out)
        usage = Usage(prompt_tokens=self.n_prompt, completion_tokens=n, cached_tokens=self.cached)
        result = Result(
            text=text, token_ids=tuple(self.out), finish_reason=finish, usage=usage,
            timings=timings, tool_calls=tool_calls, context_shifts=self.shifts,
            discarded_tokens=self.discarded, error=error,
            logprobs=tuple(self.logprobs) if self.request.sampling.logprobs is not None else None,
            speculative=(SpeculativeStats(mode=self.request.speculative or "", **self.spec,
                                          switched_off=self.spec_off)
                         if speculative_mode(self.request.speculative) != "off" else None),
        )  # fmt: skip
        ids, self.pending = tuple(self.pending), []
        return Chunk(tail, ids, result=result)


_END = object()
PREFIX_MIN = 16  # finished sequences shorter than this are not worth a place in the prefix cache


class _AsyncOut:
    """A job's output for a consumer on an event loop: the scheduler thread puts, the loop awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    async def get_async(self) -> Any:
        return await self.items.get()


@dataclass(eq=False)
class _Job:
    request: Request
    submitted: float
    ids: list[int]  # the prompt's tokens
    constraint: Any = None  # structured.Constraint: the grammar its output follows
    cancel: threading.Event = field(default_factory=threading.Event)
    out: queue.Queue | _AsyncOut = field(default_factory=queue.Queue)


@dataclass(eq=False)
class _Live:
    """A job holding a slot."""

    job: _Job
    seq: Seq
    asm: Assembler
    left: int  # prompt tokens not yet evaluated
    hit: Any = None  # prefix_cache.Hit its KV was restored from (held until it ends)


class Scheduler:
    """Chooses what each step evaluates: every decoding sequence, plus a bounded prefill chunk.

    With nothing decoding, a prompt goes in `max_batch`-token steps. While sequences decode, a new
    prompt gets a chunk sized so that the step costs about `PREFILL_SHARE` decode steps more than a
    decode step alone (measured as it runs): running streams slow down by a bounded factor instead of
    stalling for a whole long prompt (Sarathi-style chunked prefill).
    """

    # extra decode-step times one step may spend on prompt tokens. 1.5 let the p95 time per token
    # of 4 streams grow 3.2-3.9x beside a 4,000-token prompt here (a chunk's cost is not linear in
    # its tokens); 0.75 kept it at 2.3-2.5x (bench/server.py), the long prompt reading slower
    PREFILL_SHARE = 0.75
    MIN_CHUNK = 4  # on a slow CPU one prompt token can cost a sixth of a 3-sequence decode step
    FIRST_CHUNK = 16  # before a prompt token's cost has been measured

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max(1, max_batch)
        self.t_decode = 0.0  # seconds per decode-only step (moving average)
        self.t_token = 0.0  # seconds per prompt token (moving average)

    def chunk(self, decoding: int) -> int:
        if not decoding:
            return self.max_batch
        if not (self.t_decode and self.t_token):
            return min(self.max_batch, self.FIRST_CHUNK)
        n = int(self.PREFILL_SHARE * self.t_decode / self.t_token)
        return max(min(self.MIN_CHUNK, self.max_batch), min(self.max_batch, n))

    def plan(self, running: Sequence[_Live]) -> dict[_Live, int]:
        decoding = [r for r in running if r.left == 0]
        plan = {r: 0 for r in decoding}
        budget = min(self.chunk(len(decoding)), self.max_batch - len(decoding))
        for r in running:
            if r.left and budget > 0:
                plan[r] = n = min(r.left, budget)
                budget -= n
        return plan

    def observe(self, plan: Mapping[_Live, int], seconds: float) -> None:
        prompt = sum(plan.values())
        decoding = sum(1 for n in plan.values() if n == 0)

        def avg(old: float, new: float) -> float:
            return new if not old else 0.8 * old + 0.2 * new

        if not prompt:
            self.t_decode = avg(self.t_decode, seconds)
        elif decoding and self.t_decode:
            self.t_token = avg(self.t_token, max(0.0, seconds - self.t_decode) / prompt)
        elif not decoding:
            self.t_token = avg(self.t_token, seconds / prompt)


class Stream:
    """The chunks of one submitted request. Iterate it; `cancel()` stops generation within a token.

    Submitted with `loop=` (`Model.submit`), it is iterated with `async for` on that loop instead:
    the scheduler thread hands chunks over with `call_soon_threadsafe`, so no thread of the loop's
    executor waits on a token.
    """

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.result: Result | None = None
        self._done = False

    @property
    def submitted(self) -> float:
        return self._job.submitted

    @property
    def n_prompt(self) -> int:
        return len(self._job.ids)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        if isinstance(self._job.out, _AsyncOut):
            raise TypeError("this stream was submitted for an event loop: use `async for`")
        if self._done:
            raise StopIteration
        return self._take(self._job.out.get())

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Chunk:
        out = self._job.out
        if not isinstance(out, _AsyncOut):
            raise TypeError("submit with loop= to iterate a stream with `async for`")
        if self._done:
            raise StopAsyncIteration
        try:
            return self._take(await out.get_async())
        except StopIteration:
            raise StopAsyncIteration from None

    def _take(self, item: Any) -> Chunk:
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
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
        if isinstance(self._job.out, _AsyncOut):
            return  # the scheduler ends it within a step; nobody needs to wait for that
        for _ in self:
            pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()




class Model:
    """A loaded model: one backend, one scheduler thread, a queue. The Python API's `llm`."""

    def __init__(self, backend: Backend | Any, name: str, *, load_s: float = 0.0,
                 options: LoadOptions | None = None,
                 sampling_defaults: Mapping[str, Any] | None = None,
                 backend_why: str = "") -> None:  # fmt: skip
        if not hasattr(backend, "admit"):
            backend = OneSlot(backend)
        self.backend = backend
        self.name = name
        self.load_s = load_s
        self.backend_why = backend_why  # how the registry chose it ("auto: llama.cpp runs here ...")
        self.options = options or LoadOptions()
        self.context = self.options.context
        self.sampling_defaults = dict(sampling_defaults or {})
        self.parallel = max(1, min(self.options.parallel, int(getattr(backend, "n_slots", 1))))
        self.scheduler = Scheduler(int(getattr(backend, "max_batch", 512)))
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"localllm:{name}", daemon=True)
        self._closed = False
        self._first = True
        budget = getattr(backend, "prefix_budget", 0) if getattr(backend, "prefix_kind", None) else 0
        self.prefix_cache = RadixCache(backend, budget) if budget else None
        self.running = 0  # sequences holding a slot, as of the last step (for metrics and `ps`)
        self.waiting = 0  # submitted requests waiting for a slot
        self._thread.start()

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    def kv_bytes(self) -> int | None:
        """Bytes the backend's KV caches hold now, where it can say (None: it cannot)."""
        held = getattr(self.backend, "kv_bytes", None)
        return held() if callable(held) else None

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    # -- the scheduler thread --------------------------------------------------------------------

    def _work(self) -> None:
        waiting: deque[_Job] = deque()
        running: list[_Live] = []
        closing = False
        while True:
            self.running, self.waiting = len(running), len(waiting)
            block = not running and not waiting and not closing
            try:
                while True:  # everything submitted since the last step
                    job = self._queue.get(block=block)
                    block = False
                    if job is None:
                        closing = True
                    else:
                        waiting.append(job)
            except queue.Empty:
                pass
            if closing:
                for live in running:
                    self._end(live, live.asm.finish("cancelled"))
                for job in waiting:
                    job.out.put(LocalLLMError("the model was closed"))
                    job.out.put(_END)
                return
            for job in [j for j in waiting if j.cancel.is_set()]:
                waiting.remove(job)
                self._admit(job)  # cancelled while waiting: it ends now, without a slot
            while waiting and len(running) < self.parallel:
                live = self._admit(waiting.popleft())
                if live is not None:
                    running.append(live)
            for live in [r for r in running if r.job.cancel.is_set()]:
                running.remove(live)
                self._end(live, live.asm.finish("cancelled"))
            self.running, self.waiting = len(running), len(waiting)
            if running:
                self._step(running)

    def _admit(self, job: _Job) -> _Live | None:
        """Prepare a waiting job and give it a slot; errors go to its consumer, not the model."""
        try:
            request, ids = job.request, job.ids
            asm = Assembler(self.backend, request, len(ids), submitted=job.submitted,
                            load_s=self.load_s if self._first else 0.0)  # fmt: skip
            self._first = False
            if job.cancel.is_set() or request.sampling.max_tokens == 0:
                job.out.put(asm.finish("cancelled" if job.cancel.is_set() else "length"))
                job.out.put(_END)
                return None
            seq = Seq(ids, request.sampling, request.context, request.speculative, job.constraint)
            cache = self.prefix_cache
            if cache is not None and not request.context.enabled:
                hit = cache.match(ids[:-1])  # at least one prompt token is evaluated, for logits
                seq.prefix = hit if hit.n else None
            asm.cached = cached = self.backend.admit(seq)
            live = _Live(job, seq, asm, left=len(ids) - cached)
            if seq.prefix is not None:  # the backend restored it (else it set it to None)
                cache.hold(seq.prefix)  # type: ignore[union-attr]
                live.hit = seq.prefix
            return live
        except Exception as e:  # noqa: BLE001 - reported to the consumer as one line
            job.out.put(_one_line(e))
            job.out.put(_END)
            return None

    def _step(self, running: list[_Live]) -> None:
        plan = self.scheduler.plan(running)
        t0 = time.perf_counter()
        try:
            got = self.backend.step({live.seq: n for live, n in plan.items()})
        except Exception as e:  # noqa: BLE001 - every sequence in the step fails; the model lives
            error = _one_line(e)
            for live in plan:
                running.remove(live)
                if live.asm.out or live.asm.t_first:
                    self._end(live, live.asm.finish(error=str(error)), keep=False)
                else:
                    self._release(live, keep=False)
                    live.job.out.put(error)
                    live.job.out.put(_END)
            return
        self.scheduler.observe(plan, time.perf_counter() - t0)
        for live, n in plan.items():
            steps = got.get(live.seq, [])
            if live.left and not steps:
                live.left = max(0, live.left - n)
                continue
            live.left = 0
            if not steps:  # a decoding sequence that cannot go on: its context is full
                running.remove(live)
                self._end(live, live.asm.finish("length"))
                continue
            for st in steps:
                chunk = live.asm.feed(st)
                if chunk is not None:
                    live.job.out.put(chunk)
                if live.asm.done:
                    break
            if live.asm.done:
                running.remove(live)
                self._end(live, live.asm.finish())

    def _release(self, live: _Live, keep: bool) -> None:
        cache = self.prefix_cache
        if cache is not None:
            if live.hit is not None:
                cache.let_go(live.hit)
            if keep:
                with contextlib.suppress(Exception):  # a cache that cannot keep it just does not
                    tokens = self.backend.prefix_tokens(live.seq)
                    if len(tokens) >= PREFIX_MIN:
                        cache.insert(tokens, lambda a, b: self.backend.prefix_save(live.seq, a, b))
        with contextlib.suppress(Exception):  # a slot that cannot be kept is the backend's to drop
            self.backend.release(live.seq, keep)

    def _end(self, live: _Live, last: Chunk, keep: bool = True) -> None:
        live.job.out.put(last)  # the answer first; keeping its KV is the engine's own business
        live.job.out.put(_END)
        self._release(live, keep)

    # -- submitting ----------------------------------------------------------------------------

    def submit(self, request: Request, *, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        """Queue a request. What cannot run is refused here, in the caller's thread, before it
        waits for a slot: unsupported fields, a template that fails, a prompt that does not fit.
        (Rendering and tokenizing here also keeps them off the thread that steps the model.)

        With `loop`, the stream is consumed with `async for` on that event loop."""
        if self._closed:
            raise LocalLLMError("the model is closed")
        submitted = time.perf_counter()
        if request.context == ContextPolicy() and self.context.enabled:
            request = replace(request, context=self.context)
        check_supported(request, self.capabilities, self.backend.name)
        constraint = None
        if self.capabilities.grammar:
            from localllm.structured import constraint_for

            constraint = constraint_for(self.backend, request)
        if constraint is not None:
            # a drafted token would need the grammar's state rolled back on rejection: not yet
            if speculative_mode(request.speculative) != "off":
                raise Unsupported("speculative decoding cannot be combined with constrained output "
                                  "(response_format or a forced tool call) yet")  # fmt: skip
            request = replace(request, speculative="off")  # the model's default mode too
        elif request.speculative is None and self.options.speculative:
            request = replace(request, speculative=self.options.speculative)
        ids = prompt_ids(self.backend, request)
        check_context(len(ids), self.backend.n_ctx, request.sampling, request.context)
        job = _Job(request, submitted, ids, constraint=constraint)
        if loop is not None:
            job.out = _AsyncOut(loop)
        self._queue.put(job)
        return Stream(job)

    # -- the Python API (PRODUCT.md) -----------------------------------------------------------

    def sampling(self, **kw: Any) -> SamplingParams:
        """Sampling options over this model's defaults (GGUF, else catalog, else global)."""
        given = {k: v for k, v in kw.items() if v is not None}
        return SamplingParams.from_kwargs(**(self.sampling_defaults | given))

    def _request(self, prompt: str | Sequence[Message], **kw: Any) -> Request:
        tools = kw.pop("tools", ())
        tool_choice = kw.pop("tool_choice", None)
        response_format = kw.pop("response_format", None)
        speculative = kw.pop("speculative", None)
        parallel_calls = kw.pop("parallel_tool_calls", True)
        sampling = self.sampling(**kw)
        if isinstance(prompt, str):
            return Request(prompt=prompt, sampling=sampling, response_format=response_format,
                           speculative=speculative)  # fmt: skip
        return Request(messages=tuple(prompt), tools=tuple(tools), tool_choice=tool_choice,
                       parallel_tool_calls=parallel_calls, response_format=response_format,
                       speculative=speculative, sampling=sampling)  # fmt: skip

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
            raise Unsupported(f"the {self.backend.name} backend has no embeddings")
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


def _one_line(e: BaseException) -> LocalLLMError:
    if isinstance(e, LocalLLMError):
        return e
    return LocalLLMError(f"generation failed: {type(e).__name__}: {e}")


# -- loading -----------------------------------------------------------------------------------

_GGUF_SAMPLING = {  # GGUF general.sampling.* → SamplingParams
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}


def sampling_defaults(path: Any, catalog: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """A model's sampling defaults and where they came from: its GGUF `general.sampling.*` keys,
    else its catalog entry's, else none (the global defaults of `SamplingParams`)."""
    from localllm.gguf_file import GGUFFile

    found: dict[str, Any] = {}
    try:
        with GGUFFile(path) as gf:
            for key, name in _GGUF_SAMPLING.items():
                v = gf.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    found[name] = int(v) if name in ("top_k", "repeat_last_n") else float(v)
    except (LocalLLMError, OSError):
        found = {}
    if found:
        try:
            SamplingParams.from_kwargs(**found)
            return found, "model file"
        except LocalLLMError:
            pass  # a file with impossible defaults gets none of them
    if catalog:
        return dict(catalog), "catalog"
    return {}, "global"


def load(model: str, options: LoadOptions | None = None, *, check_memory: bool = True,
         **kw: Any) -> Model:  # fmt: skip
    """Load a model by name (registering the offline default on first use) and start its worker.

    `options` (or keyword options, which override it: `ctx=2048, kv_cache="q8_0"`) fix the engine;
    the backend is chosen by the registry, and everything it cannot do is refused before loading.
    """
    from localllm import backends
    from localllm.errors import DoesNotFit
    from localllm.memory import resolve_ctx
    from localllm.model_info import human_bytes
    from localllm.models_registry.catalog import ensure_local, sampling_for
    from localllm.models_registry.store import Store

    if "n_threads" in kw:
        kw["threads"] = kw.pop("n_threads")
    opts = (options or LoadOptions()).replace(**kw) if kw else (options or LoadOptions())
    spec = backends.describe(opts.backend, opts)  # auto: the first that can honour opts
    check_options(opts, spec.capabilities, spec.name)
    store = Store()
    record = ensure_local(model, store)
    opts = opts.replace(ctx=resolve_ctx(record.info, opts.ctx))
    if check_memory:
        est = spec.estimate(record.info, opts)
        if not est.fits:
            per = f" for {opts.parallel} sequences" if opts.parallel > 1 else ""
            raise DoesNotFit(
                f"{record.name} at context {opts.ctx}{per} needs {human_bytes(est.total_bytes)} "
                f"(weights {human_bytes(est.weights_bytes)}, KV {human_bytes(est.kv_bytes)}, "
                f"compute {human_bytes(est.compute_bytes)}) but {human_bytes(est.available_bytes)} "
                f"is free on {est.device}; try a smaller --ctx, --parallel or --kv-cache q8_0"
            )
    path = store.path_of(record)
    defaults, _source = sampling_defaults(path, sampling_for(record))
    # With auto, a backend that refuses the file as it opens it (llama.cpp's first load may find
    # that it computes wrong numbers for this file here, where torch is right) is passed over for
    # the next that suits it; when none is left, or the next refuses the options, the error says
    # what each one that was tried said.
    failed: dict[str, str] = {}
    while True:
        try:
            chosen, why = backends.select(opts.backend, path, failed=failed, options=opts)
            if chosen is not spec:
                check_options(opts, chosen.capabilities, chosen.name)
        except LocalLLMError:
            if not failed:
                raise
            said = (next(iter(failed.values())) if len(failed) == 1
                    else "; ".join(f"{n} failed: {r}" for n, r in failed.items()))  # fmt: skip
            raise LocalLLMError(f"{record.name}: {said}") from None
        t0 = time.perf_counter()
        try:
            b = chosen.open(path, opts, name=record.name, digest=record.digest, home=store.home)
            break
        except LocalLLMError as e:
            reason = str(e).removeprefix(f"{record.name}: ")
            if opts.backend != "auto":
                raise LocalLLMError(f"{record.name}: {reason}") from None
            failed[chosen.name] = reason
    return Model(b, record.name, load_s=time.perf_counter() - t0, options=opts,
                 sampling_defaults=defaults, backend_why=why)  # fmt: skip


def choose_backend(backend: str = "auto") -> str:
    """The name of the backend a load will use, or `BackendUnavailable` saying why none can run."""
    from localllm import backends

    return backends.choose(backend).name
