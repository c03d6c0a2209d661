"""One sequence's output: tokens become text, chunks and a `Result`, the same for every runner.

`Step` is one sampled token with what happened to get it; `Assembler` decodes UTF-8 pieces
incrementally, finds stop strings across chunk borders (`StopMatcher`), separates a thinking
model's reasoning from its answer (`reasoning.Splitter`), ends the sequence at its limits and
assembles timings, usage, logprobs, tool calls and speculative statistics.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localllm.chat import parse_tool_calls, repeats_call
from localllm.engine.reasoning import Splitter
from localllm.types import (
    Chunk,
    FinishReason,
    Request,
    Result,
    SpeculativeStats,
    Timings,
    TokenLogprob,
    Usage,
    speculative_mode,
)

__all__ = ["Assembler", "Step", "StopMatcher"]


@dataclass(frozen=True)
class Step:
    """One sampled token, with what happened to get it."""

    token: int
    cached: int = 0  # on the first step: prompt tokens reused from the cache
    shifted: tuple[int, ...] = ()  # tokens discarded by context shifts since the last step
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    # speculative decoding, on the first Step of each decode pass: target passes it took (1), the
    # tokens drafted and accepted in it; `spec_off` says why speculation switched itself off
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_off: str = ""


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.hit: str | None = None  # the stop string found, once one is

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        buf = self.pending + piece
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda h: h[0])
            self.pending = ""
            return buf[:at], True
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


class Assembler:
    """Turns one sequence's `Step`s into `Chunk`s and its `Result`: the same for every runner.

    UTF-8 pieces are decoded incrementally, stop strings are found across chunk borders (text that
    could begin one is held back), limits end the sequence, and every generated token appears in
    exactly one chunk's `token_ids` (tokens whose text is held back ride with a later chunk).
    """

    def __init__(self, runner: Any, request: Request, n_prompt: int, *, submitted: float,
                 load_s: float = 0.0, splitter: Splitter | None = None) -> None:  # fmt: skip
        self.runner = runner
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
        self.splitter = splitter  # a thinking model's: reasoning apart from the answer
        self.thoughts: list[str] = []
        self.thinking_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.cached = self.shifts = self.discarded = 0
        self.finish_reason: FinishReason | None = None
        self.stop_hit = False
        self._tools = bool(request.tools) and request.tool_choice != "none"  # calls parsed at the end
        # speculative decoding: what the decode passes did (`SpeculativeStats`' fields)
        self.spec = dict.fromkeys(
            ("drafted", "accepted", "passes", "rounds", "rejections", "tokens"), 0
        )
        self.spec_off = ""
        self.drafted_at: list[int] = []  # per draft position (`SpeculativeStats`)
        self.accepted_at: list[int] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, step: Step) -> Chunk | None:
        """Take one token; returns a chunk to hand out (or None). Sets `finish_reason` when done."""
        s, b = self.request.sampling, self.runner
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
            if step.drafted:
                for at, n in ((self.drafted_at, step.drafted), (self.accepted_at, step.accepted)):
                    at.extend([0] * (step.drafted - len(at)))
                    for i in range(n):
                        at[i] += 1
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
        if self.splitter is not None:
            was = self.splitter.thinking
            thought, text = self.splitter.feed(text)
            self.thinking_tokens += was or self.splitter.thinking
        else:
            thought = ""
        chunk = None
        if text or thought or lp:
            self.texts.append(text)
            self.thoughts.append(thought)
            chunk = Chunk(text, tuple(self.pending), lp, reasoning=self._shown(thought))
            self.pending = []
        if hit:
            self.finish_reason, self.stop_hit = "stop", True
        elif self._tools and ">" in text and repeats_call("".join(self.texts)):
            self.finish_reason = "stop"  # the same call again: the turn is over (finish drops it)
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
        thought = ""
        if self.splitter is not None:
            thought, tail = self.splitter.feed(tail)
            rest = self.splitter.flush()
            thought, tail = thought + rest[0], tail + rest[1]
        self.texts.append(tail)
        self.thoughts.append(thought)
        text = "".join(self.texts)
        tool_calls: tuple = ()
        # complete calls are calls whatever ended the output; a call cut short is dropped
        if self._tools and finish in ("stop", "length"):
            content, calls = parse_tool_calls(text, cut=finish == "length")
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
        usage = Usage(prompt_tokens=self.n_prompt, completion_tokens=n, cached_tokens=self.cached,
                      reasoning_tokens=self.thinking_tokens)  # fmt: skip
        result = Result(
            text=text, token_ids=tuple(self.out), finish_reason=finish, usage=usage,
            timings=timings, tool_calls=tool_calls, context_shifts=self.shifts,
            discarded_tokens=self.discarded, error=error, stop_sequence=self.stops.hit if self.stop_hit else None,
            reasoning=(self._shown("".join(self.thoughts)) or None) if self.splitter else None,
            logprobs=tuple(self.logprobs) if self.request.sampling.logprobs is not None else None,
            speculative=(SpeculativeStats(mode=self.request.speculative or "", **self.spec,
                                          switched_off=self.spec_off,
                                          drafted_at=tuple(self.drafted_at),
                                          accepted_at=tuple(self.accepted_at))
                         if speculative_mode(self.request.speculative) != "off" else None),
        )  # fmt: skip
        ids, self.pending = tuple(self.pending), []
        return Chunk(tail, ids, result=result, reasoning=self._shown(thought))

    def _shown(self, thought: str) -> str:
        """Reasoning is handed out unless the request said `think: false`."""
        return "" if self.request.think is False else thought
