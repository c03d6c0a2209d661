"""`localllm bench`: latency percentiles, throughput, cost per million tokens and the hardware's
decode ceiling, measured against the in-process engine or a running server.

Each request streams `gen_tokens` tokens (past end-of-generation tokens: `ignore_eos`) after a
prompt of about `prompt_tokens` tokens; every prompt starts differently, so no request reuses
another's KV cache. At each concurrency level `requests` requests are sent by that many clients,
each sending its next request when its last one ends.

What is reported, per level:
- TTFT (submit → first token), TPOT (time per output token after the first: decode time ÷
  (tokens − 1)) and end-to-end latency, as p50 / p95 / p99 and mean;
- aggregate output tokens/s (all completion tokens ÷ the level's wall time), input tokens/s
  alike, and prompt processing tokens/s (prompt tokens ÷ the time from getting a slot to the
  first token — the TTFT against a server, which does not say — median over requests);
- the aggregate prefill rate: all prompt tokens ÷ the time during which at least one request
  was processing its prompt (the union of the requests' slot → first token intervals). Under
  concurrency a request's own prompt rate shrinks as its prefill shares the machine with other
  streams; the machine's does not, so this, not the per-request rate, prices input;
- with a price (USD per hour of the machine, or watts × price per kWh): USD per million output
  tokens at the aggregate output rate, and per million input tokens at the aggregate prefill
  rate (each as if the machine's time went to that work alone, as such prices are quoted);
- the decode ceiling: a decode step must read every weight once (whatever the batch) and each
  sequence's KV cache, so c streams cannot pass c · bandwidth / (weights + c · KV bytes), with
  the bandwidth measured by a probe here; the level's decode rate as a % of it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from localllm.errors import Cancelled, LocalLLMError

__all__ = [
    "Sample",
    "Price",
    "summarize",
    "percentile",
    "level_report",
    "decode_ceiling",
    "memory_bandwidth",
    "weight_bytes_of_file",
    "run_bench",
]

PERCENTILES = (50, 95, 99)


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """p50, p95, p99 and mean of `values` (NaN when there are none)."""
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else math.nan
    return out


@dataclass(frozen=True)
class Sample:
    """One request's timings (seconds) and token counts."""

    ttft_s: float  # submit → first token
    decode_s: float  # first token → last token
    e2e_s: float  # submit → last byte
    prompt_tokens: int
    completion_tokens: int
    # slot → first token: prompt processing without the wait for a slot (the engine says it;
    # a server does not, so there it is the TTFT)
    prompt_s: float | None = None
    start_s: float | None = None  # when it was sent (time.perf_counter), to overlay requests

    @property
    def prefill_s(self) -> float:
        """How long its prompt took: the engine's prompt time, else (a server) the TTFT."""
        return self.prompt_s or self.ttft_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        n = self.completion_tokens
        return self.decode_s / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class Price:
    """What an hour of this machine costs: a GPU's (or cloud machine's) hourly price, or power
    drawn at an electricity price."""

    usd_per_hour: float
    basis: str  # how it was given, for the report

    @classmethod
    def of(cls, gpu_cost_per_hour: float | None = None, watts: float | None = None,
           kwh_price: float | None = None) -> Price | None:  # fmt: skip
        """From the command's options (None when no price was given)."""
        if gpu_cost_per_hour is not None:
            if (watts, kwh_price) != (None, None):
                raise LocalLLMError("give --gpu-cost-per-hour or --watts with --kwh-price, not both")
            if not (math.isfinite(gpu_cost_per_hour) and gpu_cost_per_hour >= 0):
                raise LocalLLMError(f"--gpu-cost-per-hour must be >= 0, got {gpu_cost_per_hour}")
            return cls(gpu_cost_per_hour, f"{gpu_cost_per_hour:g} USD per hour")
        if watts is None and kwh_price is None:
            return None
        if watts is None or kwh_price is None:
            raise LocalLLMError("--watts and --kwh-price go together (power × price per kWh)")
        for name, v in (("--watts", watts), ("--kwh-price", kwh_price)):
            if not (math.isfinite(v) and v >= 0):
                raise LocalLLMError(f"{name} must be >= 0, got {v}")
        return cls(watts / 1000.0 * kwh_price, f"{watts:g} W at {kwh_price:g} USD per kWh")

    def per_million(self, tokens_per_s: float) -> float | None:
        """USD per million tokens produced at `tokens_per_s` (None at no throughput)."""
        if not tokens_per_s > 0:
            return None
        return self.usd_per_hour / (tokens_per_s * 3600.0) * 1e6


def decode_ceiling(bandwidth: float, weight_bytes: float, kv_bytes_per_seq: float,
                   streams: int = 1) -> float:  # fmt: skip
    """Aggregate decode tokens/s that `streams` sequences cannot pass: each step reads every
    weight once and each sequence's KV cache. bandwidth in bytes/s."""
    per_step = weight_bytes + streams * kv_bytes_per_seq
    return streams * bandwidth / per_step if per_step > 0 else math.inf


def prefill_busy_s(samples: Sequence[Sample]) -> float | None:
    """Seconds during which at least one request was processing its prompt: the union of the
    intervals (sent + TTFT − prompt time, sent + TTFT). None when a sample lacks its send time."""
    spans = []
    for s in samples:
        if s.start_s is None:
            return None
        end = s.start_s + s.ttft_s
        spans.append((end - s.prefill_s, end))
    busy, reach = 0.0, -math.inf
    for lo, hi in sorted(spans):
        lo = max(lo, reach)
        if hi > lo:
            busy += hi - lo
            reach = hi
    return busy


def level_report(concurrency: int, samples: Sequence[Sample], wall_s: float,
                 price: Price | None = None, ceiling: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The numbers of one concurrency level (see the module's docstring)."""
    out_tokens = sum(s.completion_tokens for s in samples)
    in_tokens = sum(s.prompt_tokens for s in samples)
    tpots = [t for s in samples if (t := s.tpot_s) is not None]
    prefill = [s.prompt_tokens / s.prefill_s for s in samples if s.prefill_s > 0 and s.prompt_tokens]
    per_request = percentile(prefill, 50) if prefill else 0.0
    agg = out_tokens / wall_s if wall_s > 0 else 0.0
    busy = prefill_busy_s(samples)  # None without send times: the per-request rate stands in
    prefill_rate = per_request if busy is None else (in_tokens / busy if busy > 0 else 0.0)
    # the decode rate while streams decode together: streams / TPOT (prefill pauses included)
    decode_rate = min(concurrency, len(samples)) / percentile(tpots, 50) if tpots else 0.0
    r: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(samples),
        "wall_s": wall_s,
        "prompt_tokens": in_tokens,
        "completion_tokens": out_tokens,
        "ttft_s": summarize([s.ttft_s for s in samples]),
        "tpot_s": summarize(tpots),
        "e2e_s": summarize([s.e2e_s for s in samples]),
        "output_tokens_per_s": agg,
        "input_tokens_per_s": in_tokens / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens_per_s": per_request,
        "prefill_tokens_per_s": prefill_rate,
        "decode_tokens_per_s": decode_rate,
    }
    if price is not None:
        r["usd_per_million_output"] = price.per_million(agg)
        r["usd_per_million_input"] = price.per_million(prefill_rate)
    if ceiling is not None:
        r["ceiling_tokens_per_s"] = ceiling
        r["ceiling_fraction"] = decode_rate / ceiling if ceiling > 0 else None
    return r


# -- the machine --------------------------------------------------------------------------------


def memory_bandwidth(device: str = "cpu", *, threads: int | None = None, nbytes: int = 256 << 20,
                     repeats: int = 5) -> float:  # fmt: skip
    """Read bandwidth in bytes/s: the best of `repeats` sums over an array far larger than the
    caches. On a CPU each of `threads` threads (default: all cores) sums its own slice, as a
    decode step's threads read their share of the weights; on a GPU one reduction does."""
    if device not in ("cpu", "auto"):
        import torch

        dev = torch.device(device)
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        if dev.type == "mps":
            sync = torch.mps.synchronize
        x.sum()
        sync()
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            sync()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best
    import numpy as np

    n = max(1, threads or os.cpu_count() or 1)
    x = np.ones(nbytes // 4, dtype=np.float32)  # pages touched now, not inside the timing
    parts = np.array_split(x, n)
    best = math.inf
    for _ in range(repeats):
        barrier = threading.Barrier(n + 1)
        ends: list[float] = []

        def read(part: np.ndarray, barrier: threading.Barrier = barrier, ends: list[float] = ends) -> None:
            barrier.wait()
            part.sum()  # numpy releases the GIL for the reduction
            ends.append(time.perf_counter())

        workers = [threading.Thread(target=read, args=(p,)) for p in parts]
        for w in workers:
            w.start()
        barrier.wait()
        t = time.perf_counter()
        for w in workers:
            w.join()
        best = min(best, max(ends) - t)
    return x.nbytes / best


def weight_bytes_of_file(path: str | os.PathLike[str]) -> int:
    """Bytes of a GGUF's weights one decode step reads: every tensor but the token embedding,
    of which only one row is read — unless the output head is tied to it (no `output.weight`),
    when the head reads all of it."""
    from localllm.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        sizes = {name: t.nbytes for name, t in f.tensors.items()}
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total


# -- running requests ---------------------------------------------------------------------------


def default_quality_text() -> str:
    """The opening of Alice's Adventures in Wonderland (public domain), shipped with localllm:
    the prose of the benchmark's prompts and `recommend`'s default quality text."""
    return resources.files("localllm").joinpath("data/quality.txt").read_text(encoding="utf-8")


def prompts_for(tokenize: Callable[[str], list[int]], n_tokens: int, count: int,
                start: int = 0) -> list[str]:  # fmt: skip
    """`count` prompts of about `n_tokens` tokens each: prose (the built-in public-domain text),
    each starting with its own number and at its own place in the text, so that none shares a
    cached prefix with another — and not a repeated sentence, which would flatter prompt-lookup
    drafting."""
    prose = " ".join(default_quality_text().split())
    unit = max(1, len(tokenize(prose)))
    body = prose * (n_tokens // unit + 2)
    out = []
    for i in range(start, start + count):
        at = (i * 397) % len(prose)
        text = f"Request {i}: " + body[at:]
        n = len(tokenize(text))
        while n > n_tokens:  # cut by characters in proportion until it fits
            text = text[: max(1, min(len(text) - 1, int(len(text) * n_tokens / n)))]
            n = len(tokenize(text))
        out.append(text)
    return out


def _run_level(send: Callable[[str], Sample], prompts: Sequence[str], concurrency: int,
               on_done: Callable[[], None] | None = None,
               cancel: threading.Event | None = None) -> tuple[list[Sample], float]:  # fmt: skip
    """Send `prompts` from `concurrency` client threads; returns the samples and the wall time.
    A set `cancel` stops the clients before their next request (a running one finishes)."""
    lock = threading.Lock()
    todo = list(prompts)
    samples: list[Sample] = []
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                if not todo or errors or (cancel is not None and cancel.is_set()):
                    return
                prompt = todo.pop(0)
            try:
                sent = time.perf_counter()
                s = send(prompt)
                if s.start_s is None:
                    s = replace(s, start_s=sent)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                with lock:
                    errors.append(e)
                return
            with lock:
                samples.append(s)
            if on_done is not None:
                on_done()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if cancel is not None and cancel.is_set():
        raise Cancelled("the benchmark was cancelled")
    return samples, wall


def engine_sender(llm: Any, gen_tokens: int) -> Callable[[str], Sample]:
    """Requests to a loaded `localllm.engine.Model`; timings as the engine measures them."""
    from localllm.types import Request, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)

    def send(prompt: str) -> Sample:
        result = llm.submit(Request(prompt=prompt, sampling=sampling)).wait()
        if result.finish_reason == "error":
            raise LocalLLMError(f"a request failed: {result.error or 'error'}")
        t, u = result.timings, result.usage
        return Sample(t.ttft_s, t.decode_s, t.total_s, u.prompt_tokens, u.completion_tokens, t.prompt_s or None)

    return send


@dataclass
class Server:
    """A running server's API (`openai` or `ollama`) at `url`, and the model it serves."""

    url: str
    api: str
    model: str
    api_key: str | None = None
    timeout: float = 600.0
    client: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        import httpx

        self.url = self.url.rstrip("/")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.Client(timeout=self.timeout, headers=headers)

    @classmethod
    def connect(cls, url: str, model: str | None, api: str = "auto",
                api_key: str | None = None) -> Server:  # fmt: skip
        """Find out which API `url` speaks (auto: OpenAI's /v1/models, else Ollama's /api/tags)
        and which model to ask for (default: the first it lists)."""
        import httpx

        if api not in ("auto", "openai", "ollama"):
            raise LocalLLMError(f"--api must be auto, openai or ollama, not {api}")
        s = cls(url, api, model or "", api_key)
        tried = []
        for kind, route in (("openai", "/v1/models"), ("ollama", "/api/tags")):
            if api not in ("auto", kind):
                continue
            try:
                r = s.client.get(s.url + route)
            except httpx.HTTPError as e:
                raise LocalLLMError(f"cannot reach {url}: {e}") from None
            if r.status_code == 401:
                raise LocalLLMError(f"{url} wants an API key: give --api-key")
            if r.status_code != 200:
                tried.append(f"{route} answered {r.status_code}")
                continue
            try:
                data = r.json()
                names = ([m["id"] for m in data["data"]] if kind == "openai"
                         else [m["name"] for m in data["models"]])  # fmt: skip
            except (ValueError, KeyError, TypeError):
                tried.append(f"{route} answered something else than a model list")
                continue
            s.api = kind
            if not s.model:
                if not names:
                    raise LocalLLMError(f"{url} serves no model: name one")
                s.model = names[0]
            return s
        raise LocalLLMError(f"{url} speaks neither the OpenAI nor the Ollama API ({'; '.join(tried)})")

    def tokenize(self, text: str) -> list[int]:
        """A server does not tokenize for us: about 4 characters a token (English)."""
        return [0] * max(1, len(text) // 4)

    def send(self, prompt: str, gen_tokens: int) -> Sample:
        if self.api == "openai":
            body = {"model": self.model, "prompt": prompt, "max_tokens": gen_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
            route = "/v1/completions"
        else:
            body = {"model": self.model, "prompt": prompt, "raw": True, "stream": True,
                    "options": {"num_predict": gen_tokens, "temperature": 0}}  # fmt: skip
            route = "/api/generate"
        t0 = time.perf_counter()
        first = last = 0.0
        usage: dict[str, int] = {}
        pieces = 0
        with self.client.stream("POST", self.url + route, json=body) as r:
            if r.status_code != 200:
                r.read()
                raise LocalLLMError(f"{self.url}{route} answered {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                data = self._event(line)
                if data is None:
                    continue
                text, done_usage = self._parse(data)
                if text:
                    last = time.perf_counter()
                    first = first or last
                    pieces += 1
                if done_usage:
                    usage = done_usage
        end = time.perf_counter()
        n_out = usage.get("completion_tokens", pieces)
        return Sample(ttft_s=(first or end) - t0, decode_s=(last - first) if first else 0.0,
                      e2e_s=end - t0, prompt_tokens=usage.get("prompt_tokens", 0),
                      completion_tokens=n_out)  # fmt: skip

    def _event(self, line: str) -> dict[str, Any] | None:
        if self.api == "openai":
            if not line.startswith("data:"):
                return None
            line = line[5:].strip()
            if line == "[DONE]":
                return None
        if not line.strip():
            return None
        try:
            data = json.loads(line)
        except ValueError:
            raise LocalLLMError(f"{self.url} sent a line that is not JSON: {line[:80]!r}") from None
        if isinstance(data, dict) and "error" in data:
            raise LocalLLMError(f"{self.url}: {data['error']}")
        return data if isinstance(data, dict) else None

    def _parse(self, data: dict[str, Any]) -> tuple[str, dict[str, int] | None]:
        if self.api == "openai":
            text = "".join(c.get("text") or "" for c in data.get("choices") or [])
            u = data.get("usage")
            usage = ({"prompt_tokens": int(u.get("prompt_tokens", 0)),
                      "completion_tokens": int(u.get("completion_tokens", 0))} if u else None)  # fmt: skip
            return text, usage
        text = data.get("response") or ""
        if data.get("done"):
            return text, {"prompt_tokens": int(data.get("prompt_eval_count", 0)),
                          "completion_tokens": int(data.get("eval_count", 0))}  # fmt: skip
        return text, None

    def close(self) -> None:
        self.client.close()


# -- the whole run ------------------------------------------------------------------------------


def _levels(concurrency: Sequence[int]) -> list[int]:
    levels = sorted(set(int(c) for c in concurrency))
    if not levels or levels[0] < 1 or levels[-1] > 256:
        raise LocalLLMError(f"--concurrency levels must be between 1 and 256, got {list(concurrency)}")
    return levels


def machine() -> dict[str, Any]:
    """What ran it: CPU model, cores, memory, torch's CPU capability or GPU when torch is loaded."""
    import platform

    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
                           "platform": platform.platform()}  # fmt: skip
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    return out


def run_bench(model: str | None, *, options: Any = None, url: str | None = None, api: str = "auto",
              api_key: str | None = None, prompt_tokens: int = 128, gen_tokens: int = 64,
              concurrency: Sequence[int] = (1,), requests: int | None = None,
              price: Price | None = None, probe: bool = True,
              progress: Callable[[str, int, int], None] | None = None,
              cancel: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
    """Benchmark `model` in this process (with `options`, a LoadOptions) or at `url`.

    `requests` per level (default: 2 × the level, at least 4). `progress(label, done, total)` is
    called as requests finish; a set `cancel` stops it (LocalLLMError). Returns the report
    `--json` prints."""
    from localllm.types import LoadOptions

    levels = _levels(concurrency)
    if prompt_tokens < 1 or gen_tokens < 2:
        raise LocalLLMError("--prompt-tokens must be >= 1 and --gen-tokens >= 2 (TPOT needs two tokens)")
    if requests is not None and requests < 1:
        raise LocalLLMError(f"--requests must be >= 1, got {requests}")
    per_level = {c: requests or max(4, 2 * c) for c in levels}
    report: dict[str, Any] = {"prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
                              "price": asdict(price) if price else None}  # fmt: skip
    closers: list[Callable[[], None]] = []
    try:
        if url is not None:
            server = Server.connect(url, model, api, api_key)
            closers.append(server.close)
            report |= {"target": "server", "url": server.url, "api": server.api, "model": server.model}
            tokenize = server.tokenize

            def send(p: str) -> Sample:
                return server.send(p, gen_tokens)

            ceiling_inputs = None
        else:
            from localllm.engine import load
            from localllm.memory import kv_bytes_per_token, parse_kv_cache
            from localllm.models_registry.catalog import ensure_local
            from localllm.models_registry.store import Store

            if model is None:
                raise LocalLLMError("name a model to benchmark (or --url for a running server)")
            opts = (options or LoadOptions()).replace(parallel=max(levels))
            need_ctx = prompt_tokens + gen_tokens + 64
            if opts.ctx is None or opts.ctx < need_ctx:
                opts = opts.replace(ctx=need_ctx)
            store = Store()
            record = ensure_local(model, store)
            llm = load(record.name, opts)
            closers.append(llm.close)
            tokenize = llm.tokenize
            send = engine_sender(llm, gen_tokens)
            weights = _weight_bytes(llm.runner, store.path_of(record))
            kv_per_token = kv_bytes_per_token(record.info, *parse_kv_cache(opts.kv_cache))
            ceiling_inputs = (weights, kv_per_token * (prompt_tokens + gen_tokens / 2))
            report |= {"target": "engine", "model": llm.name, "backend": llm.runner.name,
                       "kv_cache": opts.kv_cache, "speculative": opts.speculative,
                       "device": llm.runner.device,
                       "weights_bytes_per_token": weights,
                       "kv_bytes_per_token": kv_per_token}  # fmt: skip
        bandwidth = None
        if probe and ceiling_inputs is not None:
            dev = str(report.get("device") or "cpu")
            bandwidth = memory_bandwidth("cpu" if dev in ("auto", "cpu") else dev)
            report["memory_bandwidth_bytes_per_s"] = bandwidth
        # one short request first: the first one pays for warm-up (graphs, caches, allocation)
        warm = prompts_for(tokenize, min(prompt_tokens, 16), 1, start=-1)[0]
        send(warm)
        report["levels"] = []
        offset = 0
        for c in levels:
            prompts = prompts_for(tokenize, prompt_tokens, per_level[c], start=offset)
            offset += per_level[c]
            done = [0]

            def tick(c: int = c, done: list[int] = done) -> None:
                done[0] += 1
                if progress is not None:
                    progress(f"concurrency {c}", done[0], per_level[c])

            samples, wall = _run_level(send, prompts, c, tick, cancel)
            ceiling = None
            if bandwidth is not None and ceiling_inputs is not None:
                ceiling = decode_ceiling(bandwidth, ceiling_inputs[0], ceiling_inputs[1], c)
            report["levels"].append(level_report(c, samples, wall, price, ceiling))
    finally:
        for close in reversed(closers):
            close()
    report["machine"] = machine()
    return report


def _weight_bytes(runner: Any, path: Path) -> int:
    """Weight bytes a decode step reads, as the runner holds them (the torch engine may keep
    other precisions than the file's), else the file's."""
    held = runner.decode_weight_bytes()
    return int(held) if held else weight_bytes_of_file(path)
