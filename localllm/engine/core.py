"""The engine: sequences in slots, one scheduler thread per loaded model, one output assembler.

    front doors ──submit(Request)──▶ queue ──▶ scheduler thread ──▶ runner.forward(pieces)
          ◀──── Chunk … Chunk(result=Result) ◀── Assembler (UTF-8, stop strings, limits, tools)

Front doors only submit and consume. The scheduler admits waiting requests into free slots between
steps (`slots`: which slot, what of its cache is reused; the prefix cache), evaluates new prompts in
bounded chunks beside the decode steps of running sequences (`scheduler`), and checks every
sequence's cancel flag before each step. Decoding is the engine's, once for every runner: the
sampler (`sampling`), the grammar mask, speculative drafts and their verification
(`speculative`), context checks, UTF-8-safe incremental text, stop strings, finish reasons and
timings (`output`). A runner (`localllm.backends.base.Runner`) only evaluates tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from localllm.backends import Capabilities, check_options
from localllm.backends.base import MEDIA_MARKER, Piece, Runner
from localllm.engine.output import Assembler, Step
from localllm.engine.reasoning import Splitter, template_args, thinking_of
from localllm.engine.sampling import Choice, Sampler, logprobs
from localllm.engine.scheduler import Scheduler
from localllm.engine.slots import Slot, Slots
from localllm.engine.speculative import (
    DRAFT_K,
    HEAD_K,
    LOOKUP_K,
    TREE_COST,
    TREE_NODES,
    TREE_WIDTH,
    Draft,
    DraftModel,
    HeadDrafter,
    LayerSkip,
    Lookup,
    Pace,
    accept_path,
    check_speculative,
)
from localllm.errors import ContextOverflow, LocalLLMError, OutOfBlocks, Unsupported
from localllm.prefix_cache import RadixCache
from localllm.types import (
    Chunk,
    ContextPolicy,
    Drained,
    LoadOptions,
    Message,
    Request,
    Result,
    SamplingParams,
    speculative_mode,
)

# -- refuse, never ignore ------------------------------------------------------------------------


def check_supported(request: Request, caps: Capabilities, backend: str) -> None:
    """Every request field the backend lacks is one `Unsupported` line, never silently ignored."""
    rf = request.response_format
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise Unsupported(
                f"response_format type {kind!r} is not one of text, json_object, json_schema"
            )
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
    if mode != "auto" and mode not in caps.speculative:
        raise Unsupported(
            f"the {backend} backend has no speculative mode {mode!r} (it has: {', '.join(caps.speculative)})"
        )
    if request.context.enabled and not caps.streaming:
        raise Unsupported(f"the {backend} backend cannot shift its context (--streaming)")


# -- prompts and context -------------------------------------------------------------------------


def prompt_ids(backend: Runner, request: Request,
               model: str = "the model") -> tuple[list[int], Splitter | None]:  # fmt: skip
    """Render (chat) or take (raw) the prompt and tokenize it. Returns its tokens and, where the
    model thinks, what separates its reasoning: a chat's template says whether the model thinks
    and takes `think` (`reasoning`); a raw prompt's output is split only when the request asks
    for thinking."""
    if request.fim is not None:
        return fim_ids(backend, request, model), None
    template = backend.chat_template
    thinking = thinking_of(template)
    messages, images = placed_images(request)
    if images and "image" not in backend.media:
        raise Unsupported(f"{model} cannot read images here: that needs its vision projector "
                          "(`localllm import --mmproj`) and the llama.cpp backend")  # fmt: skip
    if messages is not None:
        text = render_chat(backend, request, model, messages)
        bos = backend.bos_text()
        add_special = not (bos and text.startswith(bos))  # the template wrote BOS itself
    else:
        template_args(thinking, request.think, model)  # refuses what the model cannot do
        text, add_special = "".join(MEDIA_MARKER + "\n" for _ in images) + (request.prompt or ""), True
        thinking = thinking if request.think not in (None, False) else None
    if images:
        ids = backend.tokenize_media(text, images, add_special=add_special)
    else:
        ids = backend.tokenize(text, add_special=add_special)
    if not ids:
        raise LocalLLMError("the prompt is empty")
    return ids, Splitter.for_prompt(thinking, text) if thinking is not None else None


# fill-in-the-middle markers by their text in the vocabulary, as llama.cpp finds them when a GGUF
# does not name them: (prefix, suffix, middle) of Qwen2.5-Coder, StarCoder, Santacoder, CodeLlama,
# DeepSeek-Coder; and the file separators repository-level FIM puts between files
FIM_MARKERS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"), ("<PRE>", "<SUF>", "<MID>"),
               ("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))  # fmt: skip
FILE_SEPARATORS = ("<|file_sep|>", "<file_sep>")
_fim: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


def fim_tokens(backend: Runner) -> dict[str, int]:
    """The runner's FIM marker ids by role (pre, suf, mid; sep where it has one); {} when its
    vocabulary has no complete set. A marker is a text the tokenizer makes one token of (control
    tokens have no text of their own to search for). Found once per runner."""
    found = _fim.get(backend)
    if found is None:

        def one(text: str) -> int | None:
            ids = backend.tokenize(text, add_special=False)
            return ids[0] if len(ids) == 1 else None

        found = {}
        for set_ in FIM_MARKERS:
            ids = [one(t) for t in set_]
            if None not in ids:
                found = dict(zip(("pre", "suf", "mid"), ids, strict=True))
                break
        sep = next((i for i in map(one, FILE_SEPARATORS) if i is not None), None)
        if found and sep is not None:
            found["sep"] = sep
        _fim[backend] = found
    return found


def fim_ids(backend: Runner, request: Request, model: str = "the model") -> list[int]:
    """A fill-in-the-middle prompt (prefix-suffix-middle order): [SEP file]... PRE prefix SUF suffix
    MID prompt, the markers by id and each text tokenized apart."""
    marks = fim_tokens(backend)
    if not marks:
        raise Unsupported(f"{model} has no fill-in-the-middle tokens (<|fim_prefix|>, <fim_prefix>, <PRE> or "
                          "the like): infill needs a code model trained for it, such as Qwen2.5-Coder")  # fmt: skip
    if request.fim_files and "sep" not in marks:
        raise Unsupported(f"{model} has no file separator token, so other files cannot be shown to it")
    assert request.fim is not None
    prefix, suffix = request.fim

    def tok(text: str) -> list[int]:
        return backend.tokenize(text, add_special=False) if text else []

    ids = backend.tokenize("", add_special=True)  # BOS where the model starts with one
    for name, text in request.fim_files:
        ids += [marks["sep"], *tok(f"{name}\n{text}")]
    ids += [marks["pre"], *tok(prefix), marks["suf"], *tok(suffix), marks["mid"], *tok(request.prompt or "")]
    return ids


def render_chat(backend: Runner, request: Request, model: str = "the model",
                messages: tuple[Message, ...] | None = None) -> str:  # fmt: skip
    """A chat request's messages and tools through the model's template (`messages`: them with
    their images placed, as `placed_images` gives)."""
    if messages is None:
        messages, _ = placed_images(request)
        if messages is None:
            raise LocalLLMError("the request has a raw prompt, not messages: no template applies")
    extra = template_args(thinking_of(backend.chat_template), request.think, model)
    return backend.chat_template.render(messages, tools=request.tools, **extra)


def placed_images(request: Request) -> tuple[tuple[Message, ...] | None, list[bytes]]:
    """The request's messages with a MEDIA_MARKER where each of their images goes, and the images
    in prompt order. A message's `images` go where its content has markers (OpenAI's image parts
    leave one each), the rest before its text (Ollama's `images`); a raw prompt's go first."""
    if request.messages is None:
        return None, list(request.images)
    out, images = [], []
    for m in request.messages:
        mine = list(m.get("images") or ())
        if not mine:
            out.append(m)
            continue
        content = m.get("content") or ""
        missing = len(mine) - content.count(MEDIA_MARKER)
        if missing < 0:
            raise LocalLLMError(f"a message places {content.count(MEDIA_MARKER)} images but has {len(mine)}")
        out.append({k: v for k, v in m.items() if k != "images"}
                   | {"content": MEDIA_MARKER * missing + ("\n" if missing and content else "") + content})  # fmt: skip
        images += mine
    return tuple(out), images


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
    splitter: Splitter | None = None  # a thinking model's reasoning apart from its answer
    cancel: threading.Event = field(default_factory=threading.Event)
    out: queue.Queue | _AsyncOut = field(default_factory=queue.Queue)


@dataclass(eq=False)
class _Live:
    """A job holding a slot: its prompt's progress, its sampler and its speculation."""

    job: _Job
    asm: Assembler
    slot: Slot
    ids: list[int]
    left: int  # prompt tokens not yet evaluated
    sampler: Sampler
    history: list[int]  # prompt + generated (penalties, prompt lookup)
    policy: ContextPolicy = field(default_factory=ContextPolicy)
    constraint: Any = None  # structured.Constraint: masks the logits, then consumes the token
    drafter: Any = None  # speculative decoding: what proposes drafts (None: off)
    pace: Pace | None = None
    last: int | None = None  # sampled, not yet evaluated
    cached: int = 0  # prompt tokens reused from a cache
    shifted: list[int] = field(default_factory=list)  # discards not yet reported in a Step
    hit: Any = None  # prefix_cache.Hit its KV was restored from (held until it ends)

    @property
    def fed(self) -> int:
        return len(self.ids) - self.left


class Model:
    """A loaded model: one runner, one scheduler thread, a queue. The Python API's `llm`."""

    def __init__(self, runner: Runner | Any, name: str, *, load_s: float = 0.0,
                 options: LoadOptions | None = None,
                 sampling_defaults: Mapping[str, Any] | None = None,
                 backend_why: str = "", draft: Runner | None = None,
                 draft_name: str | None = None, tuned: Any = None, head: Any = None,
                 digest: str = "") -> None:  # fmt: skip
        self.runner = runner
        self.name = name
        self.load_s = load_s
        self.backend_why = (
            backend_why  # how the registry chose it ("auto: llama.cpp runs here ...")
        )
        self.options = options or LoadOptions()
        self.context = self.options.context
        self.sampling_defaults = dict(sampling_defaults or {})
        self.parallel = max(1, min(self.options.parallel, int(runner.n_slots)))
        self.slots = Slots(int(runner.n_slots))
        self.scheduler = Scheduler(int(runner.max_batch))
        self.draft, self.draft_name = draft, draft_name  # a draft model's runner (`draft:NAME`)
        self._draft_model: DraftModel | None = None
        self.tuned_path = tuned  # where the `self` drafter's tuned skip set is kept
        self.head_path = head  # where `train-draft` keeps this model's draft head
        self.digest = digest  # the model file's (the store's key)
        self._self_config: Any = None
        self._head_tuning: tuple[dict[str, Any] | None] | None = None  # (`head_tuning`,), read once
        self._head_on = False  # the runner drafts with the head at `head_path` (`use_head`)
        spec = self.resolve(self.options.speculative)
        self.speculative = spec if speculative_mode(spec) != "off" else None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"localllm:{name}", daemon=True)
        self._closed = False
        self._first = True
        self._busy = threading.RLock()  # the scheduler's steps and work here, one at a time
        budget = int(runner.prefix_budget or 0)
        self.prefix_cache = RadixCache(runner, budget) if budget else None
        self.running = 0  # sequences holding a slot, as of the last step (for metrics and `ps`)
        self.waiting = 0  # submitted requests waiting for a slot
        self._deferred: list[_Job] = []  # put back to wait for KV blocks (`_make_room`)
        self._room_wait = False  # no admission until a running sequence ends and frees blocks
        self._thread.start()

    @property
    def backend(self) -> Runner:
        """The runner (its older name, for front doors that show `llm.backend.name`)."""
        return self.runner

    @property
    def capabilities(self) -> Capabilities:
        return self.runner.capabilities

    def kv_bytes(self) -> int | None:
        """Bytes the runner's KV caches hold now, where it can say (None: it cannot)."""
        held = self.runner.kv_bytes()
        return held if held else None

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

    def run_here(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (which uses the runner's slots directly: scoring, tuning) while no sequence
        is generating: between the scheduler's steps, with every slot free."""
        with self._busy:
            if any(s.busy for s in self.slots.all):
                raise LocalLLMError("the model is generating; try again when it is idle")
            self.drop_caches()
            return fn()

    @contextlib.contextmanager
    def slot_for_work(self) -> Iterator[int]:
        """A free slot for work beside the scheduler's (teacher-forced passes while tuning),
        held while the block runs and cleared after."""
        with self._busy:
            free = self.slots.free
            if not free:
                raise LocalLLMError("every slot is in use; try again when the model is idle")
            slot = free[-1]
            self.slots.take(slot)
            try:
                yield slot.sid
            finally:
                slot.busy = False
                self.runner.clear(slot.sid)
                slot.tokens, slot.exact, slot.policy = [], True, ContextPolicy()

    def generate_here(self, ids: Sequence[int], n: int, *, drafter: Any = None,
                      pace: Any = None) -> tuple[list[int], float]:  # fmt: skip
        """Up to n greedy tokens after `ids`, stepped in this thread through the engine's own
        loop (with `drafter` and `pace` when given), and the seconds the decode took after the
        first token: what `tune` measures."""
        request = Request(prompt="", sampling=SamplingParams(temperature=0, max_tokens=n,
                                                             ignore_eos=True))  # fmt: skip
        job = _Job(request, time.perf_counter(), list(ids))
        with self._busy:
            live = self._admit(job)
            if live is None:
                raise job.out.get()  # type: ignore[union-attr]
            live.drafter, live.pace = drafter, pace
            running, t0 = [live], 0.0
            while running:
                self._step(running)
                if not t0 and live.asm.out:
                    t0 = time.perf_counter()
            seconds = time.perf_counter() - t0
        while True:
            item = job.out.get()  # type: ignore[union-attr]
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
        return list(live.asm.out[:n]), seconds

    def drop_caches(self) -> None:
        """Forget what every free slot's cache holds: the next prompts are evaluated afresh."""
        for slot in self.slots.free:
            self.runner.clear(slot.sid)
            slot.tokens, slot.exact, slot.policy = [], True, ContextPolicy()
            if self._draft_model is not None:
                self._draft_model.held[slot.sid] = []
                self._draft_model.runner.clear(slot.sid)

    # -- speculation -----------------------------------------------------------------------------

    def self_config(self) -> Any:
        """The `self` drafter's skip set and draft length for this model and device: tuned once
        (`localllm.engine.tune`) and kept beside the store's models (`tuned_path`)."""
        if self._self_config is None:
            from localllm.engine import tune

            self._self_config = tune.cached_or_tuned(self)
        return self._self_config

    def head_tuning(self) -> dict[str, Any] | None:
        """What `localllm tune` measured of this model's head here (trees or a chain), read
        once; None where it has not."""
        if self._head_tuning is None:
            from localllm.engine.tune import stored_head

            self._head_tuning = (stored_head(self),)
        return self._head_tuning[0]

    def resolve(self, spec: str | None) -> str | None:
        """`auto`: the model's draft head where it has one (`train-draft`) and its backend
        drafts with heads, else prompt lookup. Other modes as they are."""
        if speculative_mode(spec) != "auto":
            return spec
        has = self.head_path is not None and Path(self.head_path).exists()
        return "head" if has and "head" in self.capabilities.speculative else "lookup"

    def use_head(self) -> None:
        """Make the runner draft with this model's head (once); one line where it has none."""
        if self._head_on:
            return
        if self.head_path is None or not Path(self.head_path).exists():
            raise LocalLLMError(f"{self.name} has no draft head yet: `localllm train-draft "
                                f"{self.name}` trains one (or use --speculative lookup)")  # fmt: skip
        self.run_here(lambda: self.runner.use_head(self.head_path, self.digest))
        self._head_on = True

    def _drafter(self, spec: str | None, policy: ContextPolicy) -> tuple[Any, Pace | None]:
        """(drafter, pace) for a sequence's speculative mode; (None, None) when off."""
        mode = speculative_mode(spec)
        if mode == "off":
            return None, None
        check_speculative(spec, policy=policy, evict=bool(self.options.evict),
                          draft_name=self.draft_name)  # fmt: skip
        if mode == "lookup":
            return Lookup(), Pace(LOOKUP_K, LOOKUP_K // 2, give_up=False)
        if mode == "draft":
            if self._draft_model is None:
                self._draft_model = DraftModel(self.draft)
            return self._draft_model, Pace(DRAFT_K, DRAFT_K // 2)
        if mode == "head":
            self.use_head()
            # it drafts by lookup too, whose misses cost little and whose hits come back where
            # the answer copies again: no switching off on rejections alone (as for lookup)
            # trees or a chain as `localllm tune` measured here; else by the measured cost of
            # a verified token
            tuned = self.head_tuning()
            width = TREE_WIDTH if tuned is None or tuned["tree"] else 1
            drafter = HeadDrafter(self.runner, lookup=True, width=width, nodes=TREE_NODES,
                                  tree_cost=TREE_COST if tuned is None else None)  # fmt: skip
            return drafter, Pace(HEAD_K, HEAD_K // 2, give_up=False)
        config = self.self_config()
        drafter = LayerSkip(self.runner, config.skip, confidence=config.confidence)
        return drafter, Pace(max(1, config.k), on=config.pays)

    def _draft_room(self, live: _Live) -> int:
        """Tokens a speculating sequence may draft now: what its pace wants, within its
        context, its max_tokens and one batch."""
        assert live.pace is not None
        r = self.runner
        k = min(live.pace.want(), r.n_ctx - r.held(live.slot.sid) - 1, r.max_batch - 1)
        max_tokens = live.asm.request.sampling.max_tokens
        if max_tokens:
            k = min(k, max_tokens - (len(live.history) - len(live.ids)) - 1)
        return k

    def draft_argmax(self, mode: str, ids: Sequence[int]) -> Any:
        """The `self` or `draft` drafter's greedy choice after every token of `ids`, teacher-
        forced (numpy (len(ids),)), for `localllm eval --speculative`; None where `self` does not
        pay on this model and device (it then decodes plainly)."""
        if mode == "self":
            config = self.self_config()
            if not config.pays:
                return None
            runner, skip = self.runner, frozenset(config.skip)
        elif self.draft is not None:
            runner, skip = self.draft, frozenset()
        else:
            raise LocalLLMError("this model was loaded without a draft model")

        def argmax() -> Any:
            from localllm.engine.scoring import teacher_argmax

            return teacher_argmax(runner, ids, skip=skip)

        return self.run_here(argmax)

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
            with self._busy:
                for job in [j for j in waiting if j.cancel.is_set()]:
                    waiting.remove(job)
                    self._admit(job)  # cancelled while waiting: it ends now, without a slot
                if not running:
                    self._room_wait = False
                while waiting and len(running) < self.parallel and not self._room_wait:
                    live = self._admit(waiting.popleft())
                    if live is not None:
                        running.append(live)
                for live in [r for r in running if r.job.cancel.is_set()]:
                    running.remove(live)
                    self._end(live, live.asm.finish("cancelled"))
                self.running, self.waiting = len(running), len(waiting)
                if running:
                    self._step(running)
                waiting.extendleft(reversed(self._deferred))  # first again, in their order
                self._deferred.clear()

    def _admit(self, job: _Job) -> _Live | None:
        """Prepare a waiting job and give it a slot; errors go to its consumer, not the model."""
        try:
            request, ids = job.request, job.ids
            asm = Assembler(self.runner, request, len(ids), submitted=job.submitted,
                            load_s=self.load_s if self._first else 0.0,
                            splitter=job.splitter)  # fmt: skip
            self._first = False
            if job.cancel.is_set() or request.sampling.max_tokens == 0:
                job.out.put(asm.finish("cancelled" if job.cancel.is_set() else "length"))
                job.out.put(_END)
                return None
            policy = request.context
            # what it refuses, it refuses before taking a slot
            drafter, pace = self._drafter(request.speculative, policy)
            hit = None
            cache = self.prefix_cache
            if cache is not None and not policy.enabled:
                found = cache.match(ids[:-1])  # at least one prompt token is evaluated, for logits
                hit = found if found.n else None
            slot, reuse = self.slots.choose(ids, policy, hit.n if hit is not None else 0)
            reuse, restored = self._reuse(slot, ids, policy, reuse, hit)
            if not restored:
                hit = None
            self.slots.take(slot)
            live = _Live(job, asm, slot, list(ids), left=len(ids) - reuse,
                         sampler=Sampler(request.sampling), history=list(ids), policy=policy,
                         constraint=job.constraint, drafter=drafter, pace=pace,
                         cached=reuse)  # fmt: skip
            asm.cached = reuse
            if hit is not None and cache is not None:
                cache.hold(hit)
                live.hit = hit
            return live
        except Exception as e:  # noqa: BLE001 - reported to the consumer as one line
            job.out.put(_one_line(e))
            job.out.put(_END)
            return None

    def _reuse(self, slot: Slot, ids: Sequence[int], policy: ContextPolicy, reuse: int,
               hit: Any) -> tuple[int, bool]:  # fmt: skip
        """Make the slot's cache hold the first `reuse` prompt tokens (or a prefix-cache hit's,
        when longer); returns how many it holds, and whether they came from the hit."""
        r, sid = self.runner, slot.sid
        if slot.policy != policy or not slot.exact:
            reuse = 0
        if hit is not None and hit.n > reuse:
            r.clear(sid, policy)
            if r.restore(sid, hit.pieces):
                slot.tokens, slot.exact, slot.policy = list(ids[: hit.n]), True, policy
                return hit.n, True
            reuse = 0
        held = r.held(sid)
        if reuse == 0:
            if held or slot.policy != policy:
                r.clear(sid, policy)
        elif held > reuse and not r.trim(sid, held - reuse, exact=True):
            r.clear(sid, policy)
            reuse = 0
        slot.tokens, slot.exact, slot.policy = list(ids[:reuse]), True, policy
        return reuse, False

    def _step(self, running: list[_Live]) -> None:
        """One step: draft, plan, evaluate the prompt chunks (one forward), then every decoding
        sequence's token (with its drafts) and every prompt's last token (the next), sample."""
        t0 = time.perf_counter()
        r = self.runner
        drafts: dict[_Live, Draft] = {}
        plan: dict[_Live, int] = {}
        body: list[tuple[_Live, list[int]]] = []
        tail: list[tuple[_Live, list[int], int]] = []  # (live, tokens, logits rows)
        try:
            for live in list(running):
                if not live.left and live.pace is not None and live.pace.on:
                    k = self._draft_room(live)
                    try:
                        drafts[live] = live.drafter.propose(live, k) if k > 0 else Draft([])
                    except OutOfBlocks:  # no room for drafts now: a plain step
                        drafts[live] = Draft([])
                    except Exception as e:  # noqa: BLE001 - its request fails, the others go on
                        running.remove(live)
                        self._fail(live, _one_line(e))
            plan = self.scheduler.plan(running, {lv: len(d.tokens) for lv, d in drafts.items()})
            full: list[_Live] = []
            for live, n in plan.items():
                if live.left:
                    tokens = live.ids[live.fed : live.fed + n]
                    if n < live.left:
                        body.append((live, tokens))
                        continue
                    # the prompt's last token goes alone, as it does when a cached prefix is
                    # reused: a row of a many-row batch may round otherwise than a row alone
                    # (llama.cpp's CPU kernels), and a greedy answer would then depend on
                    # whether the prefix was cached
                    if len(tokens) > 1:
                        body.append((live, tokens[:-1]))
                    tail.append((live, tokens[-1:], 1))
                elif not live.policy.enabled and r.held(live.slot.sid) + 1 > r.n_ctx:
                    full.append(live)  # its context is full
                else:
                    d = drafts.get(live)
                    piece = [live.last, *(d.tokens if d else ())]
                    tail.append((live, piece, len(piece) if d is not None else 1))  # type: ignore[list-item]
            if body:
                f = r.forward([Piece(lv.slot.sid, t, 0) for lv, t in body])
                for lv, t in body:
                    self._fed(lv, t, f.shifted.get(lv.slot.sid, 0))
                    lv.left -= len(t)
            out: dict[_Live, list[Step]] = {lv: [] for lv in full}
            if tail:
                marks = {lv: lv.sampler.mark() for lv, _, _ in tail}
                choices = [self._choice(lv) if lv not in drafts else None for lv, _, _ in tail]
                try:
                    f = r.forward([Piece(lv.slot.sid, t, n, c is not None,
                                         drafts[lv].piece_parents() if lv in drafts else None)
                                   for (lv, t, n), c in zip(tail, choices)])  # fmt: skip
                    drawn = iter(self._draw_on_device(f.device_rows, choices))
                except BaseException:  # the draws for a step that did not happen are undone
                    for lv, mark in marks.items():
                        lv.sampler.rewind(mark)
                    raise
                row = 0
                for (lv, t, n), choice in zip(tail, choices):
                    self._fed(lv, t, f.shifted.get(lv.slot.sid, 0))
                    cached = lv.cached if lv.left else 0
                    if choice is not None:  # drawn where the logits are: no row came back
                        step = self._took(lv, next(drawn), None, cached=cached)
                    else:
                        rows = f.logits[row : row + n]
                        row += n
                        if lv in drafts and not lv.left:
                            out[lv] = self._verify(lv, rows, drafts[lv], t0)
                            continue
                        step = self._sample(lv, rows[-1], cached=cached)
                    if lv.left:  # its prompt is complete: the first token
                        lv.left = 0
                        out[lv] = [step]
                    else:
                        out[lv] = [replace(step, passes=1)]
        except OutOfBlocks as e:  # the failed forward changed nothing: the next step retries
            self._make_room(running, _one_line(e))
            return
        except Exception as e:  # noqa: BLE001 - every sequence in the step fails; the model lives
            error = _one_line(e)
            for live in [lv for lv in running if lv in plan or lv in drafts]:
                running.remove(live)
                self._fail(live, error)
            return
        prompt = sum(plan.values())
        at = sum(n * (lv.fed - n / 2) for lv, n in plan.items()) / prompt if prompt else 0
        self.scheduler.observe(prompt, sum(1 for n in plan.values() if n == 0),
                               time.perf_counter() - t0, int(at))  # fmt: skip
        for live, steps in out.items():
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

    def _make_room(self, running: list[_Live], error: LocalLLMError) -> None:
        """A forward found no free KV block: drop what the prefix cache holds unused and what
        free slots keep of their last sequence; else put the newest sequence without output back
        to wait (first in line) until a running one ends. One with output, or alone (it cannot
        fit at all), fails with `error`."""
        cache = self.prefix_cache
        if cache is not None and cache.evict(0):
            return
        if any(self.runner.held(s.sid) for s in self.slots.free):
            self.drop_caches()
            return
        fresh = [lv for lv in running if not (lv.asm.out or lv.asm.t_first)]
        if fresh and len(running) > 1:
            live = fresh[-1]
            running.remove(live)
            self._release(live, keep=False)
            self._deferred.append(live.job)
            self._room_wait = True
            return
        live = running.pop()
        self._fail(live, LocalLLMError(f"{error}: no room for this sequence beside the others"
                                       if running else f"{error}: this request does not fit"))  # fmt: skip

    def _fail(self, live: _Live, error: LocalLLMError) -> None:
        """End a sequence with `error`: in its result once it has output, else as the error."""
        if live.asm.out or live.asm.t_first:
            self._end(live, live.asm.finish(error=str(error)), keep=False)
        else:
            self._release(live, keep=False)
            live.job.out.put(error)
            live.job.out.put(_END)

    def _fed(self, live: _Live, tokens: Sequence[int], shifted: int) -> None:
        """The slot's cache now holds `tokens` more (and forgot `shifted` before them)."""
        slot = live.slot
        if shifted:
            live.shifted.append(shifted)
            slot.exact = False
            slot.tokens = []
        if slot.exact:
            slot.tokens.extend(tokens)

    def _choice(self, live: _Live) -> Choice | None:
        """The sequence's next draw where the runner keeps its logits (the uniform drawn now),
        or None where the engine samples a host row: a runner without that, a grammar,
        logprobs, penalties."""
        if (not self.runner.logits_on_device or live.constraint is not None
                or live.asm.request.sampling.logprobs is not None):  # fmt: skip
            return None
        return live.sampler.choice()

    @staticmethod
    def _draw_on_device(rows: Any, choices: Sequence[Choice | None]) -> list[int]:
        """The tokens of the rows a forward kept on its device (one transfer of ids)."""
        wanted = [c for c in choices if c is not None]
        if not wanted:
            return []
        from localllm.engine.device_sampling import choose

        return choose(rows, wanted).tolist()

    def _sample(self, live: _Live, logits: Any, *, cached: int = 0) -> Step:
        if live.constraint is not None:
            logits = logits.copy()
            live.constraint.mask_numpy(logits)
        token = live.sampler(logits, live.history)
        if live.constraint is not None:
            live.constraint.consume(token)
        return self._took(live, token, logits, cached=cached)

    def _took(self, live: _Live, token: int, logits: Any, *, cached: int = 0,
              record: bool = True) -> Step:  # fmt: skip
        """The Step for a chosen token (its logprobs from `logits`, the row it was chosen from).
        `record`: add it to the history (`accept` has already)."""
        want = live.asm.request.sampling.logprobs
        lp, top = logprobs(logits, token, want) if want is not None else (None, ())
        step = Step(token, cached=cached, shifted=tuple(live.shifted), logprob=lp, top=top)
        live.shifted = []
        live.last = token
        if record:
            live.history.append(token)
        return step

    def _verify(self, live: _Live, rows: Any, draft: Draft, t0: float) -> list[Step]:
        """Keep what the exact rule accepts of the drafts (one target pass verified them all)
        and forget the rest from the slot's cache."""
        pace = live.pace
        assert pace is not None
        if not draft.tokens:
            step = self._sample(live, rows[-1])
            pace.plain(time.perf_counter() - t0)
            return [replace(step, passes=1)]
        tokens, path = accept_path(lambda i: rows[i], draft, live.sampler, live.history)
        n, sid = len(path), live.slot.sid
        if draft.parents is not None:  # a tree: its accepted path to the front, the rest forgotten
            start = self.runner.held(sid) - 1 - len(draft.tokens)
            self.runner.keep(sid, start, [0, *(i + 1 for i in path)])
            if live.slot.exact:
                del live.slot.tokens[start + 1 :]
                live.slot.tokens += [draft.tokens[i] for i in path]
        elif len(draft.tokens) > n:
            rejected = len(draft.tokens) - n
            self.runner.trim(sid, rejected)
            if live.slot.exact:
                del live.slot.tokens[-rejected:]
        rows = [rows[0], *(rows[i + 1] for i in path)]  # the rows the emitted tokens came from
        pace.verified(draft.depth, n, time.perf_counter() - t0, len(draft.tokens))
        steps = [self._took(live, t, rows[i], record=False) for i, t in enumerate(tokens)]
        steps[0] = replace(steps[0], passes=1, drafted=draft.depth, accepted=n)
        if not pace.on:
            steps[-1] = replace(steps[-1], spec_off=pace.reason)
        return steps

    def _release(self, live: _Live, keep: bool) -> None:
        cache, slot = self.prefix_cache, live.slot
        if cache is not None:
            if live.hit is not None:
                cache.let_go(live.hit)
            if keep and slot.exact and not live.policy.enabled:
                with contextlib.suppress(Exception):  # a cache that cannot keep it just does not
                    tokens = slot.tokens[: self.runner.held(slot.sid)]
                    if len(tokens) >= PREFIX_MIN:
                        cache.insert(tokens, lambda a, b: self.runner.save(slot.sid, a, b))
        slot.busy = False
        self._room_wait = False  # its blocks may be what a waiting request needs
        if not keep or not slot.exact:
            with contextlib.suppress(Exception):  # a slot that cannot be cleared is cleared later
                self.runner.clear(slot.sid)
            slot.tokens, slot.exact, slot.policy = [], True, ContextPolicy()

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
        explicit = request.speculative  # what the request asked, before the model's default
        if request.context == ContextPolicy() and self.context.enabled:
            request = replace(request, context=self.context)
        check_supported(request, self.capabilities, self.runner.name)
        constraint = None
        if self.capabilities.grammar:
            from localllm.structured import constraint_for

            constraint = constraint_for(self.runner, request)
        if constraint is not None:
            # a drafted token would need the grammar's state rolled back on rejection: not yet
            if speculative_mode(request.speculative) != "off":
                raise Unsupported("speculative decoding cannot be combined with constrained output "
                                  "(response_format or a forced tool call) yet")  # fmt: skip
            request = replace(request, speculative="off")  # the model's default mode too
        elif request.speculative is None and self.options.speculative:
            request = replace(request, speculative=self.options.speculative)
        if speculative_mode(request.speculative) == "auto":
            request = replace(request, speculative=self.resolve(request.speculative))
        ids, splitter = prompt_ids(self.runner, request, self.name)
        if ids and min(ids) < 0 and speculative_mode(request.speculative) == "draft":
            # images: a draft model reads none (it has no projector); the model's default
            # speculation is off for such a prompt, a request that asks for it is refused
            if explicit is not None:
                raise Unsupported("a draft model cannot read images: use --speculative off or "
                                  "lookup with images")  # fmt: skip
            request = replace(request, speculative="off")
        check_context(len(ids), self.runner.n_ctx, request.sampling, request.context)
        job = _Job(request, submitted, ids, constraint=constraint, splitter=splitter)
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
        think = kw.pop("think", None)
        parallel_calls = kw.pop("parallel_tool_calls", True)
        sampling = self.sampling(**kw)
        if isinstance(prompt, str):
            return Request(prompt=prompt, sampling=sampling, response_format=response_format,
                           speculative=speculative, think=think)  # fmt: skip
        return Request(messages=tuple(prompt), tools=tuple(tools), tool_choice=tool_choice,
                       parallel_tool_calls=parallel_calls, response_format=response_format,
                       speculative=speculative, sampling=sampling, think=think)  # fmt: skip

    def stream(self, prompt: str | Sequence[Message], **kw: Any) -> Iterator[Chunk]:
        """A string is a raw completion; a list of messages goes through the chat template."""
        with self.submit(self._request(prompt, **kw)) as s:
            yield from s

    def complete(self, prompt: str, **kw: Any) -> Result:
        return self.submit(self._request(prompt, **kw)).wait()

    def chat(self, messages: Sequence[Message], **kw: Any) -> Result:
        return self.submit(self._request(list(messages), **kw)).wait()

    def prompt_tokens(self, request: Request) -> list[int]:
        """The tokens `request`'s prompt becomes, as `submit` makes them (template, tokenizer)."""
        return prompt_ids(self.runner, request, self.name)[0]

    def fim_tokens(self) -> dict[str, int]:
        """The model's fill-in-the-middle marker ids (pre, suf, mid, sep); {} when it has none."""
        return fim_tokens(self.runner)

    def render(self, request: Request) -> str:
        """The text a chat request's messages and tools become through the model's template."""
        return render_chat(self.runner, request, self.name)

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.runner.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.runner.detokenize(tokens)

    def embed(self, texts: str | Sequence[str]) -> list[list[float]]:
        """One normalised vector per text (a separate context: generation is not disturbed)."""
        if not self.capabilities.embeddings:
            raise Unsupported(f"the {self.runner.name} backend has no embeddings")
        return self.runner.embed([texts] if isinstance(texts, str) else list(texts))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            if self.draft is not None:
                self.draft.close()
            self.runner.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream(Drained):
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

    def close(self) -> None:
        """Stop generating (if still running) and drain."""
        self.cancel()
        if isinstance(self._job.out, _AsyncOut):
            return  # the scheduler ends it within a step; nobody needs to wait for that
        for _ in self:
            pass


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


def sampling_defaults(
    path: Any, catalog: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
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
    check_speculative(opts.speculative, policy=opts.context, evict=bool(opts.evict))
    store = Store()
    record = ensure_local(model, store)
    opts = opts.replace(ctx=resolve_ctx(record.info, opts.ctx))
    if check_memory:
        est = spec.estimate(record.info, opts)
        if not est.fits and est.plan is not None:
            over = next(s for s in est.plan.shares if not s.fits)
            room = f" with {human_bytes(over.margin_bytes)} left free" if over.margin_bytes else ""
            raise DoesNotFit(
                f"{record.name} at context {opts.ctx} does not fit with {est.plan.text()}: "
                f"{over.label} needs {human_bytes(over.total_bytes)} of its "
                f"{human_bytes(over.free_bytes)} free{room}; try a smaller --ctx, --parallel, "
                f"--kv-cache q8_0 or --gpu-layers"
            )
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
            runner = chosen.open(path, opts, name=record.name, digest=record.digest,
                                 home=store.home, projector=store.projector_of(record))  # fmt: skip
            break
        except LocalLLMError as e:
            reason = str(e).removeprefix(f"{record.name}: ")
            if opts.backend != "auto":
                raise LocalLLMError(f"{record.name}: {reason}") from None
            failed[chosen.name] = reason
    draft, draft_name = None, None
    try:
        if speculative_mode(opts.speculative) == "draft":
            draft_name = opts.speculative.partition(":")[2]
            draft = _open_draft(chosen, draft_name, path, opts, store)
    except BaseException:
        runner.close()
        raise
    placed = getattr(runner, "placement", None)  # llama.cpp's offload plan, where it made one
    if placed is not None:
        why = f"{why}; {getattr(runner, 'placement_note', '') or placed.text()}"
    llm = Model(runner, record.name, load_s=time.perf_counter() - t0, options=opts,
                sampling_defaults=defaults, backend_why=why, draft=draft, draft_name=draft_name,
                tuned=store.home / "tuned" / f"{record.digest[:16]}.json",
                head=head_path(store.home, record.digest), digest=record.digest)  # fmt: skip
    if speculative_mode(llm.speculative) == "head":
        try:  # a missing or foreign head is refused at load, not at the first request
            llm.use_head()
        except BaseException:
            llm.close()
            raise
    return llm


def head_path(home: Path, digest: str) -> Path:
    """Where the draft head trained for the model file `digest` is kept in the store `home`."""
    return home / "drafts" / f"{digest[:16]}.safetensors"


def _open_draft(spec: Any, given: str, path: Any, opts: LoadOptions, store: Any) -> Runner:
    """The draft model of `--speculative draft:NAME`: a second runner of the same backend, one
    slot per slot of the target's, which must tokenize as the target does (the same token list)."""
    from localllm.gguf_file import GGUFFile
    from localllm.models_registry.catalog import ensure_local

    record = ensure_local(given, store)
    draft_path = store.path_of(record)
    with GGUFFile(path) as f, GGUFFile(draft_path) as g:
        mine = list(f.metadata.get("tokenizer.ggml.tokens") or ())
        theirs = list(g.metadata.get("tokenizer.ggml.tokens") or ())
    if mine != theirs:
        raise LocalLLMError(f"the draft model {given} has another vocabulary ({len(theirs)} "
                            f"tokens) than the model ({len(mine)}): a draft must share it")  # fmt: skip
    plain = opts.replace(speculative=None)
    return spec.open(draft_path, plain, name=record.name, digest=record.digest, home=store.home)


def choose_backend(backend: str = "auto") -> str:
    """The name of the backend a load will use, or `BackendUnavailable` saying why none can run."""
    from localllm import backends

    return backends.choose(backend).name
