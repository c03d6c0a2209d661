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

On the CPU each graph is also kept whole on disk (torch's ahead-of-time compile,
`aot_compile` / `load_compiled_function`) under the store's `cache/compiled`, named by
everything the graph depends on (`identity`: torch, this package's torch code, the model's
modules, shapes and dtypes, the bucket): a later start loads it and skips dynamo's tracing,
which was most of a warm start (inductor's own cache under `cache/inductor` keeps the kernels).
A graph that cannot be saved or loaded is compiled the usual way, with one log line. A graph
read is touched, so the folder is kept like a cache (`prune`): after each save, graphs unused
for 30 days go, then the least recently used while the folder holds over 1 GB.

The eager path is the oracle: tests compare the two (`tests/backends/torch/test_compiled.py`).
fbgemm's fp16 matmul reaches the graph as an opaque op (`quantized.fp16_gemm`), so the step is
one graph. On a 2-core EPYC, SmolLM2 in the CPU default decodes at 18.1 ms a token compiled
against 26.1 eager (bench/torch_compile.py), but the first start compiles for about a minute
and later ones still take seconds (graphs loaded from disk: the first step 5.9 s in the default
precision, 5.4 s in f32, on a Zen 1 EPYC, against 86 s cold); so `auto` compiles on CUDA only
and `--compile` asks for it on the CPU (a long-running server). The CPU default's own ops
(`quantized.fp16_gemm`, `quantized.block_rows`) are what keep its step one graph that saves.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from localllm.backends.torch.cache import Rows
from localllm.backends.torch.models.base import Step, _RowsPlan
from localllm.types import COMPILE_MODES

log = logging.getLogger(__name__)
# inductor keeps a value cast to float16 and back in float32 unless told otherwise: the pool's
# int8 codes were then made from the unrounded scale (0.7% of them one off), not the stored one
OPTIONS = {"emulate_precision_casts": True}
GRAPHS = 128  # graphs of the step kept in memory (dynamo's `recompile_limit` while it runs)
HERE = Path(__file__).resolve().parent  # the torch engine's code: a saved graph is of this code


def wanted(mode: str, device: torch.device) -> bool:
    """Whether `--compile MODE` compiles on this device: `auto` on CUDA only (see above)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r} ({', '.join(COMPILE_MODES)})")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def prepare(device: torch.device) -> threading.Thread:
    """Start, in the background, what every compiled step needs first and its inputs do not:
    importing dynamo and inductor (1.3 s on a 2-core EPYC) and, on the CPU, inductor's check of
    the vector instructions (`pick_vec_isa` builds a test program: 0.8 s). The runner starts it
    once loaded: a server's first request, after idle time, then waits 0.7 s for its first
    compiled token instead of 2.7 (SmolLM2, graphs on disk, AVX-512 EPYC); a script that
    prompts at once gains nothing (the imports contend with the prompt for the interpreter;
    beside the load they slowed it 0.85 -> 2.5 s). `CompiledStep` waits for the thread; a
    failure here is left for the step to meet."""

    def work() -> None:
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401
            import torch._inductor.compile_fx  # noqa: F401

            if device.type == "cpu":
                from torch._inductor.cpu_vec_isa import pick_vec_isa

                pick_vec_isa()

    thread = threading.Thread(target=work, name="localllm-compile-prepare", daemon=True)
    thread.start()
    return thread


def cache_dir(home: Path | None) -> Path | None:
    """Keep inductor's compiled kernels under the store (`home/cache/inductor`), so a second
    start reuses them; a TORCHINDUCTOR_CACHE_DIR the user set wins. Returns where whole
    compiled steps are kept (`home/cache/compiled`), or None without a store."""
    if home is None:
        return None
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home / "cache" / "inductor"))
    return home / "cache" / "compiled"


def identity(model: torch.nn.Module) -> str:
    """What a compiled CPU step of `model` depends on besides its inputs, as a digest: torch's
    version, the vector instructions inductor writes kernels for (a store may move between
    CPUs), the source of the torch engine, the model's modules and its parameters' and buffers'
    names, shapes and dtypes (not their values: the graph reads those at each call)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    h = hashlib.sha256(f"{torch.__version__} {platform.machine()} {pick_vec_isa()!s}".encode())
    for src in sorted(HERE.rglob("*.py")):
        h.update(src.relative_to(HERE).as_posix().encode() + src.read_bytes())
    h.update(repr(model).encode() + repr(getattr(model, "args", None)).encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
    return h.hexdigest()[:32]


def prune(folder: Path, keep: Path, *, max_bytes: int = 1 << 30, max_age_s: float = 30 * 86400) -> list[Path]:
    """Remove the graphs in `folder` last used (written or read) over `max_age_s` ago, then the
    least recently used while the rest hold over `max_bytes`; never `keep` (the one just
    written). Returns what was removed. Graphs of another torch or model version are never read
    again, so they age out; the ones in use stay."""
    now, files = time.time(), []
    for p in folder.glob("*.bin"):
        try:
            st = p.stat()
        except OSError:  # removed meanwhile (another process pruning)
            continue
        files.append((st.st_mtime, st.st_size, p))
    files.sort()  # oldest first
    total, gone = sum(size for _, size, _ in files), []
    for mtime, size, p in files:
        if p == keep or (now - mtime <= max_age_s and total <= max_bytes):
            continue
        try:
            p.unlink()
        except OSError:
            continue
        total -= size
        gone.append(p)
    if gone:
        log.info("removed %d compiled step(s) unused for long from %s", len(gone), folder)
    return gone


def _mark_dynamic(plans: dict[int, tuple[torch.Tensor, ...]]) -> None:
    """One graph for any number of key blocks: the plans' gather and bias (`_RowsPlan.tensors`,
    and StreamingLLM's cos and sin) have a dynamic size in their block dimension."""
    for plan in plans.values():
        for x in plan[2:6]:  # not `raw` (`_RowsPlan.tensors`): one per entry
            torch._dynamo.mark_dynamic(x, 1)


def _step(model: torch.nn.Module, tokens: torch.Tensor, pos: torch.Tensor,
          pools: list[tuple[tuple[torch.Tensor, ...], ...]], plans: dict[int, tuple[torch.Tensor, ...]]) -> torch.Tensor:  # fmt: skip
    """What is compiled: the model's forward over the pools and its head."""
    return model.logits(model(tokens, [pools], step=Step(pos, plans)))  # type: ignore[operator]


def _touch(path: Path) -> None:
    """Mark `path` as just used (its modification time), where the disk lets us."""
    with contextlib.suppress(OSError):
        os.utime(path)


def bucket(n: int) -> int:
    """The rows a step of n rows is padded to: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class CompiledStep:
    """`model`'s forward and head over the pools of `rows` (one `cache.Rows` per layer), compiled.

    `__call__` evaluates T tokens of each of B slots at their offsets and returns the logits
    (B·T, vocab), row after row; the caller moves the caches' offsets."""

    def __init__(self, model: torch.nn.Module, device: torch.device, saved: Path | None = None,
                 prepared: threading.Thread | None = None) -> None:  # fmt: skip
        """`saved`: the folder whole graphs are kept in (CPU only; None: compile in memory);
        `prepared`: `prepare`'s thread, waited for."""
        if prepared is not None:
            prepared.join()
        self.model, self.device = model, device
        # CUDA graphs on CUDA (what mode="reduce-overhead" sets)
        options = {**OPTIONS, "triton.cudagraphs": device.type == "cuda"}
        self._fn = torch.compile(_step, options=options)  # one function whose graphs dynamo keeps
        self.calls = 0  # steps run (tests: the compiled path was taken)
        self._pools: Sequence[Rows] | None = None  # the pools marked static (CUDA)
        self._saved = saved if device.type == "cpu" else None
        self._identity = identity(model) if self._saved is not None else ""
        self._graphs: dict[tuple, Callable[..., torch.Tensor]] = {}  # a whole graph per shape
        self._unproven: set[tuple] = set()  # graphs read from disk, not yet called
        self.loaded = self.built = 0  # graphs read from disk / compiled whole (tests, bench)

    def _graph(self, key: tuple, args: tuple[Any, ...], *, load: bool = True) -> Callable[..., torch.Tensor]:
        """The whole graph for these inputs' shapes (`key`): read from disk (`load`), else
        compiled and written there; where neither works, the in-memory compile."""
        fn = self._graphs.get(key)
        if fn is not None or self._saved is None:
            return fn or self._dynamic
        plans, path = args[4], self.path(key)
        if load:
            try:
                with path.open("rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
                self.loaded += 1
                _touch(path)  # in use: `prune` keeps it
                self._unproven.add(key)  # until its first call passes its guards
            except FileNotFoundError:
                pass
            except Exception as e:  # damaged, or of another torch: compiled again below
                log.info("saved compiled step %s not used (%s: %s)", path.name, type(e).__name__, e)
        if fn is None:
            # marked copies of the plans: a saved graph's guards want unmarked tensors at a call
            example = (*args[:4], {w: tuple(t.clone() for t in ts) for w, ts in plans.items()})
            _mark_dynamic(example[4])
            try:
                fn = torch.compile(_step, fullgraph=True, options=OPTIONS).aot_compile((example, {}))  # type: ignore[attr-defined]
            except Exception as e:  # not one whole graph (or no compiler: said at the first call)
                log.info("the compiled step is not kept on disk (%s: %s)", type(e).__name__,
                         (str(e).strip().splitlines() or [""])[0][:200])  # fmt: skip
                fn = self._dynamic
            else:
                self.built += 1
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fn.save_compiled_function(str(path))  # type: ignore[attr-defined]
                except Exception as e:  # a full or read-only disk: kept in memory only
                    log.warning("could not keep the compiled step in %s (%s)", path.parent, e)
                else:
                    prune(path.parent, path)
        self._graphs[key] = fn
        return fn

    def path(self, key: tuple) -> Path:
        """The file the graph for `key` (its inputs' shapes) is kept in."""
        assert self._saved is not None
        return self._saved / f"{self._identity}-{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}.bin"

    def _call(self, args: tuple[Any, ...]) -> torch.Tensor:
        """Run the graph for `args`; a saved one that does not take them (its guards fail) is
        compiled afresh, once, and written over."""
        tokens, _, pools, plans = args[1:]
        key = (tuple(tokens.shape), tuple(pools[0][0][0].shape),
               tuple(str(p.dtype) for parts in pools[0] for p in parts),
               tuple((w, len(p)) for w, p in plans.items()))  # fmt: skip
        fn = self._graph(key, args)
        try:
            out = fn(*args)
        except Exception as e:
            if key not in self._unproven:
                raise
            self._unproven.discard(key)
            log.info("a saved compiled step does not fit (%s): compiled again",
                     (str(e).strip().splitlines() or [""])[0][:200])  # fmt: skip
            del self._graphs[key]
            return self._graph(key, args, load=False)(*args)
        self._unproven.discard(key)
        return out

    def _dynamic(self, *args: Any) -> torch.Tensor:
        """The in-memory compile (dynamo keeps its graphs), the plans' block counts dynamic.
        Dynamo keeps 8 graphs of a function by default, then runs it eagerly for good (a warning
        line): buckets, verification lengths, windows and StreamingLLM's plans make more than
        that in a long-running server (the test suite's ninth came with StreamingLLM's and
        fell back), hence `GRAPHS`. Only the block counts are dynamic: dynamo's automatic
        dynamic shapes (a recompile on another size makes that size symbolic) made a
        verification's tokens per row and entries symbolic after a decode step, and inductor's
        graph of such a verification over int8/fp8 codes gave other logits (0.4 off) when first
        traced at 4 key blocks (at 2 it agreed; torch 2.13, upstream bug not isolated). Each shape
        is kept static, as the saved graphs (one `aot_compile` each) already were."""
        _mark_dynamic(args[4])
        with torch._dynamo.config.patch(recompile_limit=GRAPHS, automatic_dynamic_shapes=False):
            return self._fn(*args)

    def __call__(self, rows: Sequence[Rows], slots: Sequence[int], offsets: Sequence[int],
                 tokens: Sequence[Sequence[int]], *, places: Sequence[int] | None = None,
                 streams: tuple[Sequence[tuple[int, int] | None], Any] | None = None) -> torch.Tensor:  # fmt: skip
        """`offsets`: the slots' next positions (RoPE's); `places`: their next places in their
        tables where those differ (StreamingLLM slots, `streams`: their (sinks, gap), None for
        a plain slot beside them, and RoPE, as `_RowsPlan` takes them)."""
        n, t, dev = len(slots), len(tokens[0]), self.device
        places = offsets if places is None else places
        books = list({id(r.pages): r.pages for r in rows}.values())
        for pages in books:
            for s, a, o in zip(slots, places, offsets):
                pages.own(s, a, a + t, held=o + t)  # a block shared with a prefix is copied first
        for r in rows:
            r._grow()  # a static pool: allocated whole on first use
            if r.grouped:  # KIVI: blocks the step puts past the residual are coded first
                for s, a, o in zip(slots, places, offsets):
                    r.ready(s, a, a + t, held=o + t)
        size = bucket(n)
        plans = {}
        for pages in books:
            plan = _RowsPlan(pages, list(slots), places, t, pages.window, dev, rows=size * t,
                             blocks=2, streams=streams)  # fmt: skip
            plans[pages.window] = plan.tensors
        x = torch.zeros(size, t, dtype=torch.long)
        x[:n] = torch.tensor(tokens, dtype=torch.long)
        pos = torch.zeros(size, t, dtype=torch.long)
        pos[:n] = torch.tensor(offsets)[:, None] + torch.arange(t)
        pools = [r.parts for r in rows]
        if dev.type == "cuda" and self._pools is not rows:  # a graph replays on the pool's address
            for pool in pools:
                for buf in (*pool[0], *pool[1]):
                    torch._dynamo.mark_static_address(buf)
            self._pools = rows
        args = (self.model, x.to(dev), pos.to(dev), pools, plans)
        out = self._call(args)
        self.calls += 1
        return out[:n].reshape(n * t, -1)
