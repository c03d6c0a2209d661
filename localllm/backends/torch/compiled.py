"""The compiled step: a decode step (or a speculative verification of a few tokens) of rows on
the paged pool as one `torch.compile`d call (issue 33).

What changes from step to step reaches the compiled function as tensors, never as Python
numbers it would specialize on: the tokens' positions, and per window the rows plan (where each
new key goes, the blocks each query reads, the mask as a bias: `base._RowsPlan`). Around it, on
the host: the slots' blocks are made theirs (copy-on-write, `cache.Pages.own`) and the plan built
before the call, the caches' offsets moved after it. Shapes are bucketed so that a few graphs
serve every step:
- rows: the next power of two (padding rows write into the pages' `spare` block, read the zero
  block, and their logits are dropped);
- key blocks: a dynamic size (`mark_dynamic`), at least 2 (torch specializes 0 and 1);
- tokens per row: as given (1 for decode, k + 1 for a verification of k drafts).
The pools are allocated whole and never move (`cache.Rows(static=True)`), so on CUDA the step
runs as a CUDA graph (`mode="reduce-overhead"`).

The eager path is the oracle: tests compare the two (`tests/backends/torch/test_compiled.py`).
fbgemm's fp16 matmul reaches the graph as an opaque op (`quantized.fp16_gemm`), so the step is
one graph. On a 2-core EPYC, SmolLM2 in the CPU default decodes at 18.1 ms a token compiled
against 26.1 eager (bench/torch_compile.py), but the first start compiles for about a minute
and later ones still trace for ~9 s; so `auto` compiles on CUDA only and `--compile` asks for it
on the CPU (a long-running server).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from localllm.backends.torch.cache import Rows
from localllm.backends.torch.models.base import Step, _RowsPlan
from localllm.types import COMPILE_MODES


def wanted(mode: str, device: torch.device) -> bool:
    """Whether `--compile MODE` compiles on this device: `auto` on CUDA only (see above)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r} ({', '.join(COMPILE_MODES)})")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def cache_dir(home: Path | None) -> None:
    """Keep inductor's compiled kernels under the store (`home/cache/inductor`), so a second
    start reuses them; a TORCHINDUCTOR_CACHE_DIR the user set wins."""
    if home is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home / "cache" / "inductor"))


def bucket(n: int) -> int:
    """The rows a step of n rows is padded to: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class CompiledStep:
    """`model`'s forward and head over the pools of `rows` (one `cache.Rows` per layer), compiled.

    `__call__` evaluates T tokens of each of B slots at their offsets and returns the logits
    (B·T, vocab), row after row; the caller moves the caches' offsets."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        mode = "reduce-overhead" if device.type == "cuda" else None
        self._fn = torch.compile(self._run, mode=mode)
        self.calls = 0  # steps run (tests: the compiled path was taken)
        self._pools: Sequence[Rows] | None = None  # the pools marked static (CUDA)

    def _run(self, tokens: torch.Tensor, pos: torch.Tensor, pools: list[tuple[torch.Tensor, ...]],
             plans: dict[int, tuple[torch.Tensor, ...]]) -> torch.Tensor:  # fmt: skip
        model = self.model
        return model.logits(model(tokens, [pools], step=Step(pos, plans)))  # type: ignore[operator]

    def __call__(self, rows: Sequence[Rows], slots: Sequence[int], offsets: Sequence[int],
                 tokens: Sequence[Sequence[int]]) -> torch.Tensor:  # fmt: skip
        n, t, dev = len(slots), len(tokens[0]), self.device
        books = list({id(r.pages): r.pages for r in rows}.values())
        for pages in books:
            for s, o in zip(slots, offsets):
                pages.own(s, o, o + t)  # a block shared with a cached prefix is copied first
        for r in rows:
            r._grow()  # a static pool: allocated whole on first use
        size = bucket(n)
        plans = {}
        for pages in books:
            plan = _RowsPlan(pages, list(slots), offsets, t, pages.window, dev, rows=size * t,
                             blocks=2)  # fmt: skip
            torch._dynamo.mark_dynamic(plan.gather, 1)
            torch._dynamo.mark_dynamic(plan.bias, 1)
            plans[pages.window] = plan.tensors
        x = torch.zeros(size, t, dtype=torch.long)
        x[:n] = torch.tensor(tokens, dtype=torch.long)
        pos = torch.zeros(size, t, dtype=torch.long)
        pos[:n] = torch.tensor(offsets)[:, None] + torch.arange(t)
        pools = [(r.k, r.v) for r in rows]
        if dev.type == "cuda" and self._pools is not rows:  # a graph replays on the pool's address
            for pool in pools:
                for buf in pool:
                    torch._dynamo.mark_static_address(buf)
            self._pools = rows
        out = self._fn(x.to(dev), pos.to(dev), pools, plans)
        self.calls += 1
        return out[:n].reshape(n * t, -1)
