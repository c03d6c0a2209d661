"""What a backend is: capabilities it declares, and the small protocol the engine drives."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from threading import Event
from typing import Protocol

from localllm.chat import ChatTemplate
from localllm.types import ContextPolicy, SamplingParams


@dataclass(frozen=True)
class Capabilities:
    """What front doors may offer for a backend, and must refuse clearly otherwise."""

    kv_cache_types: tuple[str, ...]
    streaming: bool  # StreamingLLM context policy
    speculative: tuple[str, ...]  # modes: off, lookup, self, draft
    batching: bool  # several sequences in one step
    embeddings: bool
    grammar: bool  # constrained decoding


@dataclass(frozen=True)
class Step:
    """One sampled token, with what happened to get it."""

    token: int
    cached: int = 0  # on the first step: prompt tokens reused from the cache
    shifted: tuple[int, ...] = ()  # tokens discarded by context shifts since the last step
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Backend(Protocol):
    name: str
    capabilities: Capabilities
    n_ctx: int
    chat_template: ChatTemplate
    has_template: bool

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def is_end(self, token: int) -> bool: ...
    def bos_text(self) -> str: ...
    def steps(
        self, ids: Sequence[int], sampling: SamplingParams, policy: ContextPolicy, cancel: Event
    ) -> Iterator[Step]: ...
    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...
    def close(self) -> None: ...
