"""Memory estimate: will this model, at this context and KV-cache type, fit?

total = weights (the GGUF's tensor bytes)
      + KV cache  (per layer: ctx × kv_heads × head_dim bytes, for K and for V, GQA aware)
      + compute   (llama.cpp's scheduler buffer: dominated by f32 logits for one micro-batch)

Checked against llama.cpp's own report for the same file, context and cache type (see
tests/test_memory.py): KV bytes match exactly, compute within a few percent.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGML_TYPE_BY_NAME
from localllm.model_info import ModelInfo


@dataclass(frozen=True)
class KVType:
    """A KV-cache element type: what a token's row of it takes, and which engines have it.

    `llama_cpp` and `torch` are the type's place in that engine's list (what `show`, the doctor
    and the app print, and `--kv-cache` accepts; 0: the engine has no such cache)."""

    name: str
    block: int  # elements per block (1: unblocked)
    block_bytes: float  # bytes per block: codes, and the block's scales and zero points
    head_bytes: int = 0  # bytes per token and head on top of the rows (one f16 scale per head)
    llama_cpp: int = 0
    torch: int = 0

    def row_bytes(self, n: int, heads: int = 1) -> float:
        """Bytes for one token's row of `n` elements over `heads` heads (as ggml_row_size for
        block types)."""
        return -(-n // self.block) * self.block_bytes + self.head_bytes * heads


def _ggml(name: str, **places: int) -> KVType:
    """A ggml type, sized as ggml's type table (`gguf_file.GGML_TYPES`) has it."""
    t = GGML_TYPE_BY_NAME[name.upper()]
    return KVType(name, t.block_size, t.type_size, **places)


_GROUP = 64  # elements per f16 scale and f16 zero point in the torch engine's int4 and int2

# Every KV-cache type, once (engines take their lists from here: `kv_types`). llama.cpp's are
# ggml types; the torch engine's own (`backends.torch.kvquant`) int8 and fp8 keep one f16 scale
# per token and head, int4 and int2 a scale and a zero point per group.
KV_TYPES: dict[str, KVType] = {t.name: t for t in (
    #     name      place in llama.cpp's list, in torch's
    _ggml("f16",    llama_cpp=1, torch=1),
    _ggml("f32",    llama_cpp=2, torch=3),
    _ggml("bf16",   llama_cpp=3, torch=2),
    _ggml("q8_0",   llama_cpp=4),
    _ggml("q4_0",   llama_cpp=5),
    _ggml("q4_1",   llama_cpp=6),
    _ggml("iq4_nl", llama_cpp=7),
    _ggml("q5_0",   llama_cpp=8),
    _ggml("q5_1",   llama_cpp=9),
    KVType("int8",  1, 1, head_bytes=2, torch=4),
    KVType("fp8",   1, 1, head_bytes=2, torch=5),
    KVType("int4",  1, 0.5 + 4 / _GROUP, torch=6),
    KVType("int2",  1, 0.25 + 4 / _GROUP, torch=7),
)}  # fmt: skip
KV_CACHE_TYPES: tuple[str, ...] = tuple(KV_TYPES)
_ENGINES = {"llama.cpp": "llama_cpp", "torch": "torch"}  # engine name → its KVType column


def kv_types(engine: str) -> tuple[str, ...]:
    """The KV-cache types an engine ("llama.cpp", "torch") has, in the order it lists them."""
    if engine not in _ENGINES:
        raise ValueError(f"no engine {engine!r} (known: {', '.join(_ENGINES)})")
    column = _ENGINES[engine]
    have = [t for t in KV_TYPES.values() if getattr(t, column)]
    return tuple(t.name for t in sorted(have, key=lambda t: getattr(t, column)))


DEFAULT_CTX = 4096  # what `run` and `show` use unless --ctx says otherwise (capped by the model)
LLAMACPP_CTX_PAD = 256  # llama.cpp rounds the context up to a multiple of this
DEFAULT_UBATCH = 512  # llama.cpp's default micro-batch


def parse_kv_cache(spec: str) -> tuple[str, str]:
    """`f16` → (f16, f16); `k=q8_0,v=f16` → (q8_0, f16). Raises a one-line error otherwise."""
    spec = spec.strip().lower()
    if "=" not in spec:
        k = v = spec
    else:
        parts = dict(p.split("=", 1) if "=" in p else ("", p) for p in spec.split(","))
        if set(parts) != {"k", "v"}:
            raise LocalLLMError(f"bad --kv-cache {spec!r}: use TYPE or k=TYPE,v=TYPE")
        k, v = parts["k"].strip(), parts["v"].strip()
    for t in (k, v):
        if t not in KV_CACHE_TYPES:
            raise LocalLLMError(
                f"unknown KV cache type {t!r} (choose from {', '.join(KV_CACHE_TYPES)})"
            )
    return k, v


def element_bytes(cache_type: str, head_dim: int = 64) -> float:
    """Bytes per cached element of a type, scales and zero points included (for one head of
    `head_dim` where a type keeps one scale per head)."""
    return KV_TYPES[cache_type].row_bytes(head_dim, 1) / head_dim


def kv_bytes_per_token(info: ModelInfo, type_k: str = "f16", type_v: str = "f16") -> float:
    """What one more cached token costs, K and V over every layer: codes plus scales and zero
    points (f16: 2 bytes × 2 × layers × kv_heads × head_dim)."""
    k, v = KV_TYPES[type_k], KV_TYPES[type_v]
    return sum(k.row_bytes(h * info.head_dim_k, h) + v.row_bytes(h * info.head_dim_v, h)
               for h in info.kv_heads)  # fmt: skip


def kv_cache_bytes(info: ModelInfo, ctx: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes of the KV cache for `ctx` positions (one sequence)."""
    return int(kv_bytes_per_token(info, type_k, type_v) * ctx)


def compute_buffer_bytes(info: ModelInfo, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """llama.cpp's compute buffer: f32 logits for a micro-batch plus the widest activation."""
    return n_ubatch * (info.vocab_size + max(info.n_ff, 4 * info.n_embd)) * 4


@dataclass(frozen=True)
class Available:
    device: str  # "cpu" or "cuda:0"
    bytes: int
    total: int


def available_memory(device: str = "auto") -> Available:
    """Free memory on `device`: RAM for cpu/mps, the first NVIDIA GPU's for cuda (and for auto
    where there is one), from the device inventory (`localllm.devices`: nvidia-smi, not torch,
    unless torch is imported already, so `show` stays fast)."""
    from localllm.devices import inventory

    inv = inventory()
    if device in ("auto", "cuda"):
        gpu = next((d for d in inv.gpus if d.kind == "cuda"), None)
        if gpu is not None:
            return Available(gpu.id, gpu.free_bytes, gpu.total_bytes)
        if device == "cuda":
            raise LocalLLMError("no CUDA GPU found (nvidia-smi reports none)")
    return Available("cpu" if device != "mps" else "mps", inv.cpu.free_bytes, inv.cpu.total_bytes)


@dataclass(frozen=True)
class MemoryEstimate:
    ctx: int
    type_k: str
    type_v: str
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    device: str
    available_bytes: int
    plan: Plan | None = None  # llama.cpp on a machine with GPUs: where each layer goes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def fits(self) -> bool:
        if self.plan is not None:
            return self.plan.fits
        return self.total_bytes <= self.available_bytes

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in ("ctx", "type_k", "type_v", "weights_bytes", "kv_bytes",
                                            "compute_bytes", "device", "available_bytes")}  # fmt: skip
        return d | {"total_bytes": self.total_bytes, "fits": self.fits,
                    "plan": self.plan.to_dict() if self.plan is not None else None}  # fmt: skip


def resolve_ctx(info: ModelInfo, ctx: int | None) -> int:
    """The context a run will use: asked for, else DEFAULT_CTX capped by the model's own."""
    if ctx is None:
        return min(DEFAULT_CTX, info.context_length or DEFAULT_CTX)
    if ctx <= 0:
        raise LocalLLMError(f"--ctx must be positive, got {ctx}")
    return ctx


def estimate(
    info: ModelInfo,
    *,
    ctx: int | None = None,
    kv_cache: str = "f16",
    device: str = "auto",
    available: Available | None = None,
    parallel: int = 1,
    devices: Any = None,
    placement: dict[str, Any] | None = None,
) -> MemoryEstimate:
    """Estimate what loading `info` with the llama.cpp backend needs, and what is free.

    `parallel` sequences each get a cache of `ctx` positions (llama.cpp's per-sequence cache).
    Where the device inventory (`devices`, else the detected or described one) has GPUs and
    `device` is not cpu, the estimate carries the offload plan (`placement`: plan's gpu_layers,
    tensor_split, cpu_moe) and fits when the plan does; `available` pins one device instead.
    """
    n = resolve_ctx(info, ctx)
    padded = -(-n // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD
    type_k, type_v = parse_kv_cache(kv_cache)
    layout = None
    if available is None and device != "cpu":
        from localllm.devices import inventory

        inv = devices or inventory()
        if inv.gpus:
            layout = plan(info, inv, ctx=n, kv_cache=kv_cache, parallel=parallel,
                          **(placement or {}))  # fmt: skip
            gpu = inv.gpus[0]
            available = Available(gpu.id, gpu.free_bytes, gpu.total_bytes)
        elif devices is not None:
            available = Available("cpu", inv.cpu.free_bytes, inv.cpu.total_bytes)
    avail = available or available_memory("cpu" if device == "cpu" else "auto")
    return MemoryEstimate(
        ctx=n,
        type_k=type_k,
        type_v=type_v,
        weights_bytes=info.weights_bytes,
        kv_bytes=kv_cache_bytes(info, padded, type_k, type_v) * max(1, parallel),
        compute_bytes=compute_buffer_bytes(info),
        device=avail.device,
        available_bytes=avail.bytes,
        plan=layout,
    )


# -- placement over devices: the offload planner ---------------------------------------------
# llama.cpp numbers the repeating layers 0..L-1 and the output layer L; `n_gpu_layers` = n puts
# the last n of those on the GPUs (n = L+1: every layer and the output), the token embedding stays
# on the CPU, and each layer's KV cache lives beside it. `--n-cpu-moe N` keeps the experts of
# layers 0..N-1 in RAM while their attention runs on the GPU. Several GPUs share the offloaded
# layers in the proportions of `tensor_split`, in order.

MARGIN_MIN = 1 << 30  # per GPU: the driver's context, fragmentation, other programs
MARGIN_SHARE = 20  # ... or a twentieth of the card, whichever is larger


def margin_bytes(device: Any) -> int:
    """What the planner leaves free on a GPU (stated in `show`)."""
    return max(MARGIN_MIN, device.total_bytes // MARGIN_SHARE)


def layer_weights(info: ModelInfo) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(bytes per layer, their experts' bytes per layer, output layer's own bytes, input
    embedding's bytes). From the GGUF's tensor index; an index entry made before it was kept
    spreads the weights over the layers evenly, the embedding and output sized by the vocabulary."""
    n = info.n_layers
    if len(info.layer_bytes) == n and n:
        experts = info.expert_bytes if len(info.expert_bytes) == n else (0,) * n
        return info.layer_bytes, experts, info.output_bytes, info.embed_bytes
    per_param = info.weights_bytes / info.parameters if info.parameters else 0.5
    embed = min(int(info.vocab_size * info.n_embd * per_param), info.weights_bytes // 2)
    layers = max(0, info.weights_bytes - 2 * embed) // max(1, n)
    return (layers,) * n, (0,) * n, embed, embed


def kv_layer_bytes(info: ModelInfo, ctx: int, type_k: str = "f16", type_v: str = "f16") -> list[int]:
    """KV cache bytes of each layer for `ctx` positions."""
    k, v = KV_TYPES[type_k], KV_TYPES[type_v]
    return [int((k.row_bytes(h * info.head_dim_k, h) + v.row_bytes(h * info.head_dim_v, h)) * ctx)
            for h in info.kv_heads]  # fmt: skip


@dataclass(frozen=True)
class Share:
    """What a plan puts on one device."""

    device: str  # "cuda:0", "cpu"
    label: str  # "GPU 0", "CPU"
    layers: int  # repeating layers evaluated there
    output: bool  # the output layer is there
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    free_bytes: int
    margin_bytes: int  # left free on purpose (0 on the CPU)
    read_bytes: int  # weight bytes one decoded token reads there (active experts only)
    bandwidth: float | None

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.free_bytes - self.margin_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"total_bytes": self.total_bytes, "fits": self.fits}


@dataclass(frozen=True)
class Plan:
    """Where a llama.cpp load puts a model: `gpu_layers` (llama.cpp's n_gpu_layers, 0..L+1),
    `cpu_moe` (layers whose experts stay in RAM), `tensor_split` (per GPU), and each device's
    share of the bytes."""

    n_layers: int
    gpu_layers: int
    cpu_moe: int
    tensor_split: tuple[float, ...]
    shares: tuple[Share, ...]  # GPUs in order, then the CPU
    ctx: int
    type_k: str
    type_v: str
    request: str  # what was asked: "auto", "all" or a number

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.shares)

    @property
    def gpu_shares(self) -> tuple[Share, ...]:
        return self.shares[:-1]

    @property
    def cpu(self) -> Share:
        return self.shares[-1]

    @property
    def offloaded(self) -> int:
        """Repeating layers on GPUs."""
        return min(self.gpu_layers, self.n_layers)

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second if decoding is bound by reading the weights once per token on each
        device (an upper bound; None where a device's bandwidth is unknown)."""
        seconds = 0.0
        for s in self.shares:
            if s.read_bytes:
                if not s.bandwidth:
                    return None
                seconds += s.read_bytes / s.bandwidth
        return 1 / seconds if seconds else None

    def text(self) -> str:
        """"28/32 layers on GPU 0, 4 on CPU, KV on GPU: 1.1 GiB"."""
        from localllm.model_info import human_bytes

        L = self.n_layers
        if not self.offloaded and not any(s.output for s in self.gpu_shares):
            kv = f", KV on CPU: {human_bytes(self.cpu.kv_bytes)}" if self.gpu_shares else ""
            return f"all {L} layers on CPU" + (kv if self.gpu_shares else " (no GPU)")
        parts = [f"{s.layers}/{L} layers{' and output' if s.output else ''} on {s.label}"
                 for s in self.gpu_shares if s.layers or s.output]  # fmt: skip
        if self.cpu.layers:
            parts.append(f"{self.cpu.layers} on CPU")
        if self.cpu_moe:
            parts.append(f"experts of {min(self.cpu_moe, self.offloaded)} of them on CPU")
        gpu_kv = sum(s.kv_bytes for s in self.gpu_shares)
        kv = []
        if gpu_kv:
            kv.append(f"on GPU: {human_bytes(gpu_kv)}")
        if self.cpu.kv_bytes:
            kv.append(f"on CPU: {human_bytes(self.cpu.kv_bytes)}")
        return ", ".join(parts) + (f", KV {', '.join(kv)}" if kv else "")

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_layers": self.gpu_layers, "cpu_moe": self.cpu_moe,
                "tensor_split": list(self.tensor_split), "n_layers": self.n_layers,
                "request": self.request, "fits": self.fits, "text": self.text(),
                "decode_rate": self.decode_rate, "ctx": self.ctx,
                "shares": [s.to_dict() for s in self.shares]}  # fmt: skip


def parse_gpu_layers(value: str | int | None) -> str:
    """`--gpu-layers auto|all|N` → "auto", "all" or the number as text; one line if wrong."""
    text = "auto" if value is None else str(value).strip().lower()
    if text in ("auto", "all") or (text.isdigit() and int(text) <= _MAX_LAYERS_ASKED):
        return text if not text.isdigit() else str(int(text))
    raise LocalLLMError(f"--gpu-layers must be auto, all or a number of layers, not {value!r}")


_MAX_LAYERS_ASKED = 1 << 16


def parse_tensor_split(value: str | None) -> tuple[float, ...]:
    """`--tensor-split 3,1` → (0.75, 0.25); empty: split by free memory."""
    if not value:
        return ()
    try:
        parts = tuple(float(p) for p in value.replace("/", ",").split(","))
    except ValueError:
        raise LocalLLMError(f"--tensor-split takes proportions per GPU, e.g. 3,1; not {value!r}") from None
    if not all(p >= 0 and p == p for p in parts) or not sum(parts) > 0 or len(parts) > 16:
        raise LocalLLMError(f"--tensor-split takes up to 16 non-negative proportions, not {value!r}")
    total = sum(parts)
    return tuple(p / total for p in parts)


def plan(
    info: ModelInfo,
    devices: Any,
    *,
    ctx: int | None = None,
    kv_cache: str = "f16",
    parallel: int = 1,
    gpu_layers: str | int = "auto",
    tensor_split: tuple[float, ...] = (),
    cpu_moe: int | None = None,
    margin_scale: int = 1,
) -> Plan:
    """Place `info` on `devices` (a `devices.Inventory`) for llama.cpp.

    auto: the most layers the GPUs hold with their margins left free; for MoE models the experts
    of the first layers move to RAM first (their attention stays on the GPU), and layers leave
    the GPU only when every layer's experts are in RAM. all / N: that many, whether it fits or
    not (the plan says). `margin_scale` multiplies the margins (a retry after a failed load).
    """
    n = resolve_ctx(info, ctx)
    padded = -(-n // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD
    type_k, type_v = parse_kv_cache(kv_cache)
    request = parse_gpu_layers(gpu_layers)
    gpus = devices.gpus
    L = info.n_layers
    layers, experts, output, embed = layer_weights(info)
    kv = [b * max(1, parallel) for b in kv_layer_bytes(info, padded, type_k, type_v)]
    margins = [margin_bytes(g) * margin_scale for g in gpus]
    if tensor_split and len(tensor_split) != len(gpus):
        raise LocalLLMError(f"--tensor-split has {len(tensor_split)} parts for {len(gpus)} GPUs")
    if not tensor_split and gpus:
        room = [max(0, (min(g.free_bytes, g.total_bytes * 3 // 4) if g.unified else g.free_bytes) - m)
                for g, m in zip(gpus, margins, strict=True)]  # fmt: skip
        tensor_split = tuple(r / sum(room) for r in room) if sum(room) else (1 / len(gpus),) * len(gpus)
    active = info.n_experts_used / info.n_experts if info.n_experts and info.n_experts_used else 1.0
    wide = DEFAULT_UBATCH * max(info.n_ff, 4 * info.n_embd) * 4  # a device without the logits
    full = compute_buffer_bytes(info)

    def place(ngl: int, moe: int) -> Plan:
        ngl = min(ngl, L + 1) if gpus else 0
        start = L - min(ngl, L)  # first offloaded layer; the output (L) too when ngl > L
        w = [0] * (len(gpus) + 1)
        k = [0] * (len(gpus) + 1)
        read = [0.0] * (len(gpus) + 1)
        count = [0] * (len(gpus) + 1)
        holder = len(gpus)  # the output layer's device
        cum = [sum(tensor_split[: j + 1]) for j in range(len(gpus))]
        for il in range(L + 1):
            d = len(gpus)
            if gpus and il >= start and il - start < ngl:
                x = (il - start) / ngl
                d = next((j for j, c in enumerate(cum) if x < c - 1e-9), len(gpus) - 1)
            if il == L:
                holder = d
                w[d] += output + (embed if info.output_tied and d < len(gpus) else 0)
                read[d] += output + (embed if info.output_tied else 0)
                break
            off = experts[il] if il < moe and d < len(gpus) else 0
            w[d] += layers[il] - off
            w[-1] += off
            read[d] += layers[il] - off - (experts[il] - off) * (1 - active)
            read[-1] += off * active
            k[d] += kv[il]
            count[d] += 1
        w[-1] += embed  # the input embedding: always in RAM, one row read per token
        shares = []
        for j, dev in enumerate((*gpus, devices.cpu)):
            if j == holder:
                compute = full
            elif count[j]:
                compute = wide
            elif not dev.gpu:  # everything offloaded: a micro-batch's input embeddings
                compute = DEFAULT_UBATCH * info.n_embd * 4
            else:
                compute = 0
            free = dev.free_bytes
            if dev.unified and j < len(gpus):  # Apple: the GPU's share comes out of the same RAM,
                free = min(free, devices.cpu.free_bytes, dev.total_bytes * 3 // 4)  # ¾ at most
            shares.append(Share(dev.id, dev.label, count[j], j == holder and j < len(gpus), w[j],
                                k[j], compute, free, margins[j] if j < len(gpus) else 0,
                                int(read[j]), dev.bandwidth))  # fmt: skip
        unified = sum(s.total_bytes for s, d in zip(shares, (*gpus, devices.cpu), strict=True)
                      if d.unified)  # fmt: skip
        if unified:  # the RAM holds the CPU's share and a unified GPU's
            cpu = shares[-1]
            shares[-1] = replace(cpu, free_bytes=max(0, cpu.free_bytes - unified))
        moe = min(moe, L) if any(experts) and ngl else 0  # with no layer on a GPU, moot
        return Plan(L, ngl, moe, tuple(tensor_split) if gpus else (),
                    tuple(shares), n, type_k, type_v, request)  # fmt: skip

    if request != "auto":
        return place(L + 1 if request == "all" else int(request), cpu_moe or 0)
    if not gpus:
        return place(0, 0)
    if any(experts) and cpu_moe is None:  # experts to RAM first, then whole layers
        candidates = [(L + 1, m) for m in range(L + 1)] + [(g, L) for g in range(L, -1, -1)]
    else:
        candidates = [(g, cpu_moe or 0) for g in range(L + 1, -1, -1)]
    for ngl, moe in candidates:
        p = place(ngl, moe)
        if all(s.fits for s in p.gpu_shares):
            return p
    return place(0, 0)


def smaller_plan(info: ModelInfo, devices: Any, last: Plan, **kw: Any) -> Plan | None:
    """After a load that ran out of GPU memory with `last`: the plan with twice the margins, or
    else one layer fewer; None when nothing was on a GPU."""
    if last.gpu_layers == 0:
        return None
    p = plan(info, devices, **kw, margin_scale=2)
    if (p.gpu_layers, -p.cpu_moe) >= (last.gpu_layers, -last.cpu_moe):
        p = plan(info, devices, **(kw | {"gpu_layers": str(last.gpu_layers - 1)}))
    return p
