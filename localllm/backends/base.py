"""What a backend is: the model step the engine drives, sequence by sequence, slot by slot.

The engine (`localllm.engine`) owns the loop: which sequences run, how much of a new prompt is
evaluated per step, when a sequence stops, what text it becomes. A backend provides the step:

    admit(seq) -> cached        take a free slot for `seq`; prompt tokens reused from its cache
    step(plan) -> {seq: [Step]} one model evaluation for every planned sequence: `plan[seq]` prompt
                                tokens to evaluate (a prefill chunk), or 0 to decode. A sequence
                                whose prompt is complete samples; one *or more* tokens may come back
                                per sequence (speculative decoding). A decoding sequence that gets
                                no token cannot go on (its context is full).
    release(seq, keep)          free the slot; `keep` leaves its cache for the next prompt's prefix

A backend with one sequence at a time implements `steps()` (a generator of `Step`s, prefill
included) and is driven through `OneSlot`, so simple backends stay simple.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from threading import Event
from typing import Any, Protocol

from localllm.backends import Capabilities
from localllm.chat import ChatTemplate
from localllm.types import ContextPolicy, SamplingParams

__all__ = ["Backend", "Capabilities", "OneSlot", "Seq", "SimpleBackend", "Step", "common_prefix"]


def common_prefix(cached: Sequence[int], ids: Sequence[int], limit: int) -> int:
    """How many leading tokens of `ids` a slot's `cached` tokens already hold (at most `limit`)."""
    n, top = 0, min(len(cached), len(ids), limit)
    while n < top and cached[n] == ids[n]:
        n += 1
    return n


class Seq:
    """One sequence, as the engine hands it to a backend. `state` is the backend's to use."""

    __slots__ = ("constraint", "ids", "policy", "prefix", "sampling", "speculative", "state")

    def __init__(self, ids: Sequence[int], sampling: SamplingParams,
                 policy: ContextPolicy | None = None, speculative: str | None = None,
                 constraint: Any = None) -> None:  # fmt: skip
        self.ids = list(ids)
        self.sampling = sampling
        self.policy = policy or ContextPolicy()
        self.speculative = speculative
        # `structured.Constraint` or None: mask the logits with `mask_numpy`/`mask_torch` before
        # sampling, `consume(token)` after (a constrained sequence is never speculative)
        self.constraint = constraint
        # a `prefix_cache.Hit` for the backend to restore in `admit` when it beats what the slot
        # holds; the backend sets it to None when it does not use it
        self.prefix: Any = None
        self.state: Any = None


@dataclass(frozen=True)
class Step:
    """One sampled token, with what happened to get it."""

    token: int
    cached: int = 0  # (simple backends) on the first step: prompt tokens reused from the cache
    shifted: tuple[int, ...] = ()  # tokens discarded by context shifts since the last step
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    # speculative decoding, on the first Step of each decode pass: target passes it took (1), the
    # tokens drafted and accepted in it; `spec_off` says why speculation switched itself off
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_off: str = ""


class _Tokens(Protocol):
    name: str
    capabilities: Capabilities
    n_ctx: int  # per sequence
    chat_template: ChatTemplate
    has_template: bool

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def is_end(self, token: int) -> bool: ...
    def bos_text(self) -> str: ...
    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...
    def close(self) -> None: ...


class Backend(_Tokens, Protocol):
    """A backend with slots: what the engine's scheduler drives."""

    n_slots: int  # sequences it can hold at once
    max_batch: int  # tokens one step may evaluate

    def admit(self, seq: Seq) -> int: ...
    def step(self, plan: Mapping[Seq, int]) -> dict[Seq, list[Step]]: ...
    def release(self, seq: Seq, keep: bool = True) -> None: ...


class SimpleBackend(_Tokens, Protocol):
    """One sequence at a time: evaluate the prompt, then yield tokens until told to stop."""

    def steps(self, ids: Sequence[int], sampling: SamplingParams, policy: ContextPolicy,
              cancel: Event) -> Iterator[Step]: ...  # fmt: skip


class OneSlot:
    """Drives a `SimpleBackend` as a one-slot `Backend` (its prefill is one step, whatever the plan)."""

    n_slots = 1

    def __init__(self, backend: SimpleBackend) -> None:
        self.inner = backend
        self.max_batch = max(1, int(getattr(backend, "max_batch", 1 << 30)))
        self._gen: dict[Seq, Iterator[Step]] = {}

    def __getattr__(self, name: str) -> Any:  # tokens, template, capabilities, n_ctx, embed
        return getattr(self.inner, name)

    def admit(self, seq: Seq) -> int:
        if self._gen:
            raise RuntimeError("OneSlot holds one sequence at a time")
        self._gen[seq] = self.inner.steps(seq.ids, seq.sampling, seq.policy, Event())
        return 0  # the first Step says what was reused

    def step(self, plan: Mapping[Seq, int]) -> dict[Seq, list[Step]]:
        out: dict[Seq, list[Step]] = {}
        for seq in plan:
            gen = self._gen[seq]
            try:
                out[seq] = [next(gen)]
            except StopIteration:
                out[seq] = []
        return out

    def release(self, seq: Seq, keep: bool = True) -> None:
        gen = self._gen.pop(seq, None)
        if gen is not None:
            gen.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        for seq in list(self._gen):
            self.release(seq)
        self.inner.close()
