"""One request/result vocabulary for every front door (CLI, server, app, Python API) and backend.

A front door builds a `Request`, submits it, and reads a stream of `Chunk`s; the last chunk
carries the `Result`. Nothing here imports a backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from localllm.errors import LocalLLMError

FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]
Message = dict[str, Any]  # OpenAI-shaped: {"role": ..., "content": ..., "tool_calls": ...}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; the rest are llama.cpp's usual knobs."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None  # None: until the model stops or the context is full
    logprobs: int | None = None  # top alternatives to report per token (0: just the chosen)
    ignore_eos: bool = False  # run to max_tokens past end-of-generation tokens (benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
                "repeat_penalty must be > 0",
            ),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalLLMError(message)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> SamplingParams:
        """Build from keyword options, ignoring None values; unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(kw) - known
        if unknown:
            raise LocalLLMError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in kw.items() if v is not None})


@dataclass(frozen=True)
class ContextPolicy:
    """What to do when prompt + generation outgrow the context.

    `sinks` None: refuse with the numbers (never truncate silently). Otherwise StreamingLLM-style:
    keep the first `sinks` tokens and the most recent `window`, discarding the oldest in between.
    """

    sinks: int | None = None
    window: int = 0
    # positions forgotten at once when the window is full, at least (0: the runner's own way:
    # llama.cpp a quarter of the window, as its server shifts; torch one token at a time).
    # Scoring asks for 1, so both engines roll the same way there.
    step: int = 0

    @classmethod
    def parse(cls, spec: str | tuple[int, int] | None) -> ContextPolicy:
        if spec is None or spec == "off":
            return cls()
        if isinstance(spec, str):
            try:
                a, b = spec.split(":")
                spec = (int(a), int(b))
            except ValueError:
                raise LocalLLMError(
                    f"bad --streaming {spec!r}: use SINKS:WINDOW, e.g. 4:1020"
                ) from None
        sinks, window = spec
        if sinks < 0 or window < 8:
            raise LocalLLMError(f"bad streaming {sinks}:{window}: sinks >= 0 and window >= 8")
        return cls(sinks, window)

    @property
    def enabled(self) -> bool:
        return self.sinks is not None


_DEVICES = ("auto", "cpu", "cuda", "mps")
_DTYPES = ("auto", "f32", "bf16", "f16", "int4")  # the torch engine's working precision
_DTYPE_ALIASES = {"float32": "f32", "fp32": "f32", "bfloat16": "bf16", "float16": "f16",
                  "fp16": "f16", "half": "f16"}  # fmt: skip
DEFAULT_PARALLEL = 4


def _parse_evict(spec: str | None) -> str | None:
    if spec in (None, "", "off"):
        return None
    kind, _, budget = spec.partition(":")
    if kind != "h2o" or not budget.isdigit() or int(budget) < 8:
        raise LocalLLMError(f"bad --evict {spec!r}: use h2o:BUDGET, e.g. h2o:1024")
    return spec


def _parse_speculative(spec: str | None) -> str | None:
    if spec in (None, "", "off"):
        return None
    mode, _, model = spec.partition(":")
    if mode in ("lookup", "self", "head", "auto") and not model:
        return spec
    if mode == "draft" and model:
        return spec
    raise LocalLLMError(f"bad speculative mode {spec!r}: use off, lookup, self, head, auto or "
                        "draft:MODEL")  # fmt: skip


def speculative_mode(spec: str | None) -> str:
    """`draft:smollm2` → `draft`; None → `off` (what `Capabilities.speculative` lists)."""
    return (spec or "off").partition(":")[0]


# the torch engine's compiled step (`backends.torch.compiled`): auto (on CUDA only), on, off
COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How to load a model: everything that fixes the loaded engine (changing one means a reload).

    Checked when built, so a bad value is one line before anything loads. `to_dict` writes only what
    differs from the defaults; `from_dict` ignores keys it does not know (a conversation saved by a
    newer localllm still opens) — it keeps them in `unknown` for the caller to mention.
    """

    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    ctx: int | None = None  # per sequence; None: 4096 capped by the model's own
    kv_cache: str = "f16"
    streaming: str | None = None  # SINKS:WINDOW
    evict: str | None = None  # h2o:BUDGET
    speculative: str | None = None  # off, lookup, self, head, auto, draft:MODEL
    threads: int | None = None
    parallel: int = DEFAULT_PARALLEL  # sequences decoded together (continuous batching)
    compile: str = "auto"  # the torch engine's compiled step: COMPILE_MODES
    # llama.cpp's placement over GPUs (`memory.plan`): how many layers (auto: the planner's),
    # the split between GPUs (empty: by free memory), the layers whose MoE experts stay in RAM
    gpu_layers: str = "auto"
    tensor_split: str | None = None
    cpu_moe: int | None = None

    def __post_init__(self) -> None:
        from localllm import backends
        from localllm.memory import parse_kv_cache

        if self.backend not in backends.names():
            raise LocalLLMError(
                f"unknown backend {self.backend!r} (choose from {', '.join(backends.names())})"
            )
        if self.device not in _DEVICES:
            raise LocalLLMError(f"unknown device {self.device!r} ({', '.join(_DEVICES)})")
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in _DTYPES:
            raise LocalLLMError(f"unknown dtype {self.dtype!r} ({', '.join(_DTYPES)})")
        if self.ctx is not None and (isinstance(self.ctx, bool) or not isinstance(self.ctx, int)
                                     or self.ctx < 16):  # fmt: skip
            raise LocalLLMError(f"the context size (--ctx) must be a whole number of at least 16, got {self.ctx!r}")
        k, v = parse_kv_cache(self.kv_cache)
        object.__setattr__(self, "kv_cache", k if k == v else f"k={k},v={v}")
        if self.streaming in ("", "off"):
            object.__setattr__(self, "streaming", None)
        policy = ContextPolicy.parse(self.streaming)
        if policy.enabled:
            object.__setattr__(self, "streaming", f"{policy.sinks}:{policy.window}")
        object.__setattr__(self, "evict", _parse_evict(self.evict))
        object.__setattr__(self, "speculative", _parse_speculative(self.speculative))
        if self.threads is not None and not (isinstance(self.threads, int) and 1 <= self.threads <= 1024):
            raise LocalLLMError(f"--threads must be between 1 and 1024, got {self.threads!r}")
        if self.compile not in COMPILE_MODES:
            raise LocalLLMError(f"--compile must be {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        from localllm.memory import parse_gpu_layers, parse_tensor_split

        object.__setattr__(self, "gpu_layers", parse_gpu_layers(self.gpu_layers))
        split = parse_tensor_split(self.tensor_split)
        object.__setattr__(self, "tensor_split", ",".join(f"{p:g}" for p in split) or None)
        if self.cpu_moe is not None and (isinstance(self.cpu_moe, bool) or not isinstance(self.cpu_moe, int)
                                         or not 0 <= self.cpu_moe <= 1 << 16):  # fmt: skip
            raise LocalLLMError(f"--cpu-moe takes a number of layers, got {self.cpu_moe!r}")
        if isinstance(self.parallel, bool) or not isinstance(self.parallel, int) or not 1 <= self.parallel <= 64:
            raise LocalLLMError(f"--parallel must be between 1 and 64, got {self.parallel!r}")

    @property
    def context(self) -> ContextPolicy:
        return ContextPolicy.parse(self.streaming)

    @property
    def speculative_mode(self) -> str:
        """off, lookup, self, head, auto or draft (`Capabilities.speculative` lists all but
        auto, which a loaded model resolves: head where it has one, else lookup)."""
        return speculative_mode(self.speculative)

    @property
    def placement(self) -> dict[str, Any]:
        """`memory.plan`'s arguments for these options."""
        from localllm.memory import parse_tensor_split

        return {"gpu_layers": self.gpu_layers, "tensor_split": parse_tensor_split(self.tensor_split),
                "cpu_moe": self.cpu_moe}  # fmt: skip

    def replace(self, **kw: Any) -> LoadOptions:
        return replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        default = LoadOptions()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> LoadOptions:
        """Known keys only; None values are defaults. Bad values raise (one line)."""
        known = {f.name for f in fields(cls)}
        d = d or {}
        return cls(**{k: v for k, v in d.items() if k in known and v is not None})

    @staticmethod
    def unknown(d: dict[str, Any] | None) -> list[str]:
        known = {f.name for f in fields(LoadOptions)}
        return sorted(k for k in (d or {}) if k not in known)


@dataclass(frozen=True, kw_only=True)
class Request:
    """One generation. Exactly one of `prompt` (raw text) or `messages` (chat) is set."""

    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # with tool_choice required/named: one call or several
    response_format: dict[str, Any] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context: ContextPolicy = field(default_factory=ContextPolicy)
    speculative: str | None = None  # None: the model's (LoadOptions.speculative); "off" says off
    # thinking models: None the model's default; True/False on/off; "low"|"medium"|"high" effort
    # (engine.reasoning). False also keeps any reasoning out of the output
    think: bool | str | None = None
    # a raw prompt's images (encoded PNG/JPEG/GIF/BMP bytes); a chat's go in its messages'
    # `images` (engine.core.placed_images)
    images: tuple[bytes, ...] = ()
    # fill in the middle (editors' completion): (prefix, suffix) around the gap, and files shown
    # before them as (name, text); `prompt` is what follows the middle marker (engine.core.fim_ids)
    fim: tuple[str, str] | None = None
    fim_files: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.speculative is not None:
            object.__setattr__(self, "speculative", _parse_speculative(self.speculative) or "off")
        if (self.prompt is None) == (self.messages is None):
            raise LocalLLMError("a request needs a prompt or messages (one of them)")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(self.messages))
            for m in self.messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise LocalLLMError("each message needs a 'role'")
                if not all(isinstance(i, bytes) for i in m.get("images") or ()):
                    raise LocalLLMError("a message's images are the bytes of image files")
        elif self.images and not all(isinstance(i, bytes) for i in self.images):
            raise LocalLLMError("images are the bytes of image files")
        object.__setattr__(self, "images", tuple(self.images))
        if self.fim is not None and (self.messages is not None or self.images):
            raise LocalLLMError("fill in the middle takes a prefix and suffix, not messages or images")
        object.__setattr__(self, "tools", tuple(self.tools))

    def with_sampling(self, **kw: Any) -> Request:
        return replace(self, sampling=replace(self.sampling, **kw))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the previous request
    reasoning_tokens: int = 0  # of the completion tokens, those a thinking model thought in

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    load_s: float = 0.0
    prompt_s: float = 0.0  # prompt processing
    ttft_s: float = 0.0  # submit → first token
    decode_s: float = 0.0  # first token → last token
    total_s: float = 0.0

    def tpot_s(self, completion_tokens: int) -> float:
        """Time per output token after the first."""
        return self.decode_s / (completion_tokens - 1) if completion_tokens > 1 else 0.0

    def tokens_per_s(self, completion_tokens: int) -> float:
        t = self.tpot_s(completion_tokens)
        return 1.0 / t if t > 0 else 0.0


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class SpeculativeStats:
    """What speculative decoding did in one request's decode passes (after the first token)."""

    mode: str = ""  # lookup, self, head, draft:MODEL
    drafted: int = 0
    accepted: int = 0
    passes: int = 0  # target passes while decoding, plain ones included
    rounds: int = 0  # passes that verified drafts
    rejections: int = 0  # rounds that ended at a rejected draft (α = accepted / (accepted + this))
    tokens: int = 0  # tokens those passes yielded
    switched_off: str = ""  # why speculation switched itself off ("": it did not)
    # per draft position i (0: the first token after the last sampled one): rounds that drafted
    # a token there, and rounds whose draft there was accepted
    drafted_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_round(self) -> float:
        """Mean accepted drafts per verifying pass."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance": self.acceptance, "passes": self.passes, "rounds": self.rounds,
            "rejections": self.rejections,
            "accepted_per_round": self.accepted_per_round, "tokens_per_pass": self.tokens_per_pass,
            "switched_off": self.switched_off or None,
        }  # fmt: skip


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Result:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    tool_calls: tuple[ToolCall, ...] = ()
    context_shifts: int = 0  # times the cache dropped old tokens (ContextPolicy streaming)
    discarded_tokens: int = 0
    speculative: SpeculativeStats | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    reasoning: str | None = None  # a thinking model's reasoning, apart from `text` (the answer)
    stop_sequence: str | None = None  # the stop string that ended the output (finish "stop")

    def to_dict(self) -> dict[str, Any]:
        n = self.usage.completion_tokens
        return {
            "text": self.text,
            "reasoning": self.reasoning,
            "finish_reason": self.finish_reason,
            "tool_calls": [t.to_openai() for t in self.tool_calls],
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "cached_tokens": self.usage.cached_tokens,
                "completion_tokens": n,
                "total_tokens": self.usage.total_tokens,
            },
            "timings": {
                "load_s": self.timings.load_s,
                "prompt_s": self.timings.prompt_s,
                "ttft_s": self.timings.ttft_s,
                "tpot_s": self.timings.tpot_s(n),
                "tokens_per_s": self.timings.tokens_per_s(n),
                "prompt_tokens_per_s": (
                    self.usage.prompt_tokens / self.timings.prompt_s
                    if self.timings.prompt_s
                    else 0.0
                ),
                "total_s": self.timings.total_s,
            },
            "context_shifts": self.context_shifts,
            "discarded_tokens": self.discarded_tokens,
            "speculative": self.speculative.to_dict() if self.speculative else None,
            "error": self.error,
        }


@dataclass(frozen=True)
class Chunk:
    """A piece of the stream: new text and the tokens behind it. The last one carries `result`."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    result: Result | None = None
    reasoning: str = ""  # new reasoning text (a thinking model's, apart from the answer)


class Drained:
    """What every stream of chunks offers past iterating: `wait()` for the Result, and closing
    (`close()`, the subclass's: stop and drain) as a context manager."""

    result: Result | None

    def wait(self) -> Result:
        """Consume the rest of the stream and return its Result."""
        for _ in self:  # type: ignore[attr-defined]
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
