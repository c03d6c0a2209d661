"""A scripted backend for the engine's contract tests: bytes are tokens, the prompt says the answer.

Token ids 0..255 are bytes (so a multi-byte character spans tokens, as with a real BPE vocabulary),
256 is end-of-generation and 257 is BOS. A prompt ending in `say:TEXT` makes the sequence generate
TEXT, then end; `FAIL@K` anywhere in the prompt makes the step that would sample the K-th token
raise. `FakeBatch` has slots and chunked prefill (and records every plan it was given); `FakeSimple`
is a one-sequence backend driven through the engine's `OneSlot` adapter.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from localllm.backends import Availability, BackendSpec, Capabilities
from localllm.backends.base import Seq, Step
from localllm.chat import CHATML, ChatTemplate
from localllm.types import ContextPolicy, SamplingParams

EOS, BOS = 256, 257
CAPS = Capabilities(kv_cache_types=("f16",), streaming=False, speculative=("off",),
                    batching=True, embeddings=False, grammar=False)  # fmt: skip


def script(ids: Sequence[int]) -> list[int]:
    """What a prompt makes the fake generate: the bytes after the last `say:`, then EOS."""
    text = bytes(t for t in ids if t < 256).decode("utf-8", "replace")
    said = text.rpartition("say:")[2] if "say:" in text else "ok"
    said = said.split("<|im_end|>")[0]
    return [*said.encode("utf-8"), EOS]


def fail_at(ids: Sequence[int]) -> int | None:
    m = re.search(rb"FAIL@(\d+)", bytes(t for t in ids if t < 256))
    return int(m.group(1)) if m else None


class _Tokens:
    name = "fake"
    capabilities = CAPS
    has_template = True

    def __init__(self, n_ctx: int = 256) -> None:
        self.n_ctx = n_ctx
        self.chat_template = ChatTemplate(CHATML)
        self.closed = False

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return ([BOS] if add_special else []) + list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def is_end(self, token: int) -> bool:
        return token == EOS

    def bos_text(self) -> str:
        return ""

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


class FakeBatch(_Tokens):
    """Slots, chunked prefill, a plan log, and an optional pause per step (to watch the scheduler)."""

    def __init__(self, n_ctx: int = 256, n_slots: int = 4, max_batch: int = 64,
                 step_s: float = 0.0) -> None:  # fmt: skip
        super().__init__(n_ctx)
        self.n_slots = n_slots
        self.max_batch = max_batch
        self.step_s = step_s
        self.plans: list[dict[int, int]] = []  # per step: {slot: prompt tokens (0 = decode)}
        self.busy: dict[int, Seq] = {}
        self.released: list[tuple[int, bool]] = []
        self.lock = threading.Lock()

    def admit(self, seq: Seq) -> int:
        free = [s for s in range(self.n_slots) if s not in self.busy]
        assert free, "the engine admitted more sequences than there are slots"
        slot = free[0]
        self.busy[slot] = seq
        seq.state = {"slot": slot, "done": 0, "out": script(seq.ids), "n": 0,
                     "fail": fail_at(seq.ids)}  # fmt: skip
        return 0

    def step(self, plan: Mapping[Seq, int]) -> dict[Seq, list[Step]]:
        if self.step_s:
            time.sleep(self.step_s)
        assert sum(plan.values()) + sum(1 for n in plan.values() if n == 0) <= max(
            self.max_batch, len(plan)
        ), "a step was planned past max_batch"
        self.plans.append({seq.state["slot"]: n for seq, n in plan.items()})
        out: dict[Seq, list[Step]] = {}
        for seq, n in plan.items():
            st = seq.state
            assert st["slot"] in self.busy, "a released sequence was stepped"
            if st["done"] < len(seq.ids):
                assert n > 0, "a sequence with prompt left was planned to decode"
                st["done"] = min(len(seq.ids), st["done"] + n)
                if st["done"] < len(seq.ids):
                    out[seq] = []
                    continue
            if len(seq.ids) + st["n"] >= self.n_ctx:
                out[seq] = []  # the context is full
                continue
            if st["fail"] is not None and st["n"] + 1 >= st["fail"]:
                raise RuntimeError(f"scripted failure at token {st['fail']}")
            token = st["out"][min(st["n"], len(st["out"]) - 1)]
            st["n"] += 1
            out[seq] = [Step(token)]
        return out

    def release(self, seq: Seq, keep: bool = True) -> None:
        slot = seq.state["slot"]
        assert self.busy.get(slot) is seq, "released a sequence twice"
        del self.busy[slot]
        self.released.append((slot, keep))


class FakeSimple(_Tokens):
    """One sequence at a time, generator style (what `OneSlot` adapts)."""

    def steps(self, ids: Sequence[int], sampling: SamplingParams, policy: ContextPolicy,
              cancel: threading.Event) -> Iterator[Step]:  # fmt: skip
        out, fail = script(ids), fail_at(ids)
        for i, token in enumerate(out):
            if len(ids) + i >= self.n_ctx:
                return
            if fail is not None and i + 1 >= fail:
                raise RuntimeError(f"scripted failure at token {fail}")
            yield Step(token)
        while True:
            yield Step(EOS)


def spec(factory: str = "fakebackend:open_fake", caps: Capabilities = CAPS) -> BackendSpec:
    """A registry entry for the fake (for `load()`-level tests)."""
    from localllm.memory import estimate

    def est(info: Any, options: Any, available: Any = None) -> Any:
        return estimate(info, ctx=options.ctx, kv_cache="f16", available=available)

    return BackendSpec(name="fake", capabilities=caps, factory=factory,
                       available=lambda: Availability(True, "scripted"), estimate=est)  # fmt: skip


def open_fake(path: Path, options: Any, **_kw: Any) -> FakeBatch:
    return FakeBatch(n_ctx=options.ctx, n_slots=options.parallel)
