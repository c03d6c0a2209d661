"""llama.cpp never takes the process down: a probe and a first load in a child process, verdicts cached.

A SIGILL, SIGABRT or hang inside llama.cpp cannot be caught in Python. So before this process first
computes with llama.cpp, a child evaluates a tiny model written on the fly (`probe`), and before a
model file is first loaded here, a child loads it and evaluates a few tokens (`check_load`). If the
child dies by a signal, hangs or fails, the caller gets one line naming the cause and the fix; the
process that asked is never touched.

Verdicts are cached in the store (`guard.json`), keyed by what could change them: llama-cpp-python's
version, the size and mtime of its shared libraries, the CPU's flags, and (for a load) the file's
sha256. A rebuilt library, another CPU or another file is probed afresh; nothing else is.

    python -m localllm.backends.llamacpp_child probe DIR          the child side of `probe`
    python -m localllm.backends.llamacpp_child load PATH LAYERS   the child side of `check_load`
    python -m localllm.backends.llamacpp_child info               build facts, as JSON

This module never imports llama_cpp nor the runner (`localllm.backends.llamacpp` imports it for
`check_load`); the children's side, which does, is `localllm.backends.llamacpp_child`.

`LOCALLLM_LLAMACPP_PROBE`, when set, is a shell command run instead of the probe child (to reproduce a
crash on purpose, or to bypass the probe with `true`); it is part of the cache key.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import re
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from localllm.errors import BackendUnavailable, LocalLLMError

PROBE_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 300.0
CACHE_FILE = "guard.json"
REBUILD_FIX = (
    "rebuild llama-cpp-python for this CPU: scripts/llamacpp-build in a checkout, or "
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON' "
    "pip install --force-reinstall --no-cache-dir llama-cpp-python"
)
INSTALL_FIX = "pip install 'localllm[llamacpp]' (in a checkout: scripts/setup)"


@dataclass(frozen=True)
class Verdict:
    """Whether llama.cpp ran; `reason` and `fix` are one line each when it did not."""

    ok: bool
    reason: str = ""
    fix: str = ""
    cached: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        return f"{self.reason}; fix: {self.fix}" if self.fix else self.reason


# -- what the verdicts depend on ---------------------------------------------------------------


def _package_dir() -> Path | None:
    """llama_cpp's folder, found without importing it (importing loads the shared libraries)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def library_files() -> list[Path]:
    """The shared libraries llama-cpp-python loads (libllama, libggml*, ...)."""
    pkg = _package_dir()
    if pkg is None:
        return []
    suffixes = (".so", ".dylib", ".dll")
    return sorted(
        p for p in pkg.rglob("*") if p.is_file() and (p.suffix in suffixes or ".so." in p.name)
    )


def cpu_flags() -> str:
    """The CPU's feature flags as the kernel reports them (machine and processor elsewhere)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return f"{platform.machine()} {platform.processor()}"


def library_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def library_key() -> str | None:
    """What a verdict depends on, hashed; None when llama-cpp-python is not installed."""
    version = library_version()
    if version is None or _package_dir() is None:
        return None
    h = hashlib.sha256()
    probe = os.environ.get("LOCALLLM_LLAMACPP_PROBE", "")
    # CHECK_VERSION: verdicts of an earlier rule for "right numbers" are not this one's
    h.update(f"{version}\n{cpu_flags()}\n{probe}\n{CHECK_VERSION}\n".encode())
    for p in library_files():
        st = p.stat()
        h.update(f"{p.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


# -- the cache in the store ---------------------------------------------------------------------


def _home(home: str | os.PathLike[str] | None) -> Path:
    if home is not None:
        return Path(home)
    from localllm.home import default_home

    return default_home()


def _read_cache(home: Path) -> dict[str, Any]:
    try:
        data = json.loads((home / CACHE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(home: Path, update: dict[str, Any]) -> None:
    """Merge `update` into the cache: temporary file, then rename. A failure only costs a re-probe."""
    with contextlib.suppress(OSError):
        home.mkdir(parents=True, exist_ok=True)
        data = _read_cache(home)
        for k, v in update.items():
            if isinstance(v, dict) and isinstance(data.get(k), dict):
                data[k].update(v)
            else:
                data[k] = v
        fd, tmp = tempfile.mkstemp(dir=home, prefix=".guard-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, home / CACHE_FILE)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


# -- children -----------------------------------------------------------------------------------


def no_core_files() -> None:
    """A crash in a child must not litter core files (set by the child itself: no preexec_fn,
    which is unsafe in a process with threads, as the app is)."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass(frozen=True)
class _Exit:
    code: int | None  # None: killed after the time limit
    out: str
    err: str


def _run(args: list[str] | str, timeout: float, env: dict[str, str] | None = None) -> _Exit:
    """Run a child in its own session; on a time-out kill the whole group."""
    if isinstance(args, str):
        args = f"ulimit -c 0 2>/dev/null; {args}"
    proc = subprocess.Popen(
        args, shell=isinstance(args, str), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    if isinstance(args, str) and code is not None and 128 < code < 128 + 65:
        code = 128 - code  # the shell's way of saying its command died by signal N: 128 + N
    return _Exit(code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


_SIGNAL_MEANING = {
    "SIGILL": "illegal instruction: this build uses CPU instructions this machine cannot run",
    "SIGABRT": "llama.cpp aborted",
    "SIGSEGV": "segmentation fault",
    "SIGBUS": "bus error",
    "SIGFPE": "arithmetic fault",
    "SIGKILL": "killed (out of memory?)",
}


def _last_error(text: str, limit: int = 300) -> str:
    """The most telling line of a child's output: its last error, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for marker in ("error", "failed", "assert", "abort"):
        hits = [ln for ln in lines if marker in ln.lower()]
        if hits:
            return hits[-1][:limit]
    return lines[-1][:limit] if lines else ""


CHILD_MODULE = "localllm.backends.llamacpp_child"


def _python_child(*args: str) -> list[str]:
    return [sys.executable, "-m", CHILD_MODULE, *args]


def _child_env() -> dict[str, str]:
    """The child imports localllm from wherever this process did."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- the probe ----------------------------------------------------------------------------------


def probe(
    home: str | os.PathLike[str] | None = None,
    *,
    refresh: bool = False,
    timeout: float = PROBE_TIMEOUT_S,
) -> Verdict:
    """Can llama.cpp compute on this machine? Cached in the store; a child runs it when not."""
    key = library_key()
    if key is None:
        return Verdict(False, "llama-cpp-python is not installed", INSTALL_FIX)
    store = _home(home)
    cached = _read_cache(store).get("probe")
    if not refresh and isinstance(cached, dict) and cached.get("key") == key:
        return Verdict(bool(cached.get("ok")), str(cached.get("reason", "")),
                       str(cached.get("fix", "")), cached=True)  # fmt: skip
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="localllm-probe-") as tmp:
        command: list[str] | str = os.environ.get("LOCALLLM_LLAMACPP_PROBE") or _python_child(
            "probe", tmp
        )
        done = _run(command, timeout, env=_child_env())
    seconds = time.perf_counter() - t0
    verdict = _judge(done, timeout, what="evaluating a tiny test model")
    verdict = Verdict(verdict.ok, verdict.reason, verdict.fix, seconds=seconds)
    _write_cache(store, {"probe": {"key": key, "ok": verdict.ok, "reason": verdict.reason,
                                   "fix": verdict.fix, "at": time.time()}})  # fmt: skip
    return verdict


def _judge(done: _Exit, timeout: float, *, what: str) -> Verdict:
    if done.code == 0:
        return Verdict(True)
    if done.code is None:
        return Verdict(False, f"llama.cpp hung {what} (killed after {timeout:.0f} s)", REBUILD_FIX)
    if done.code < 0:
        name = _signal_name(done.code)
        meaning = _SIGNAL_MEANING.get(name, "crashed")
        detail = _last_error(done.err + "\n" + done.out)
        return Verdict(
            False,
            f"llama.cpp crashed with {name} ({meaning}) {what}" + (f": {detail}" if detail else ""),
            REBUILD_FIX,
        )
    detail = _last_error(done.out + "\n" + done.err) or f"exit status {done.code}"
    return Verdict(False, f"llama.cpp failed {what}: {detail}", REBUILD_FIX)


# -- the first load of a model file -------------------------------------------------------------


def check_load(
    path: str | os.PathLike[str],
    digest: str,
    name: str,
    *,
    n_gpu_layers: int = 0,
    home: str | os.PathLike[str] | None = None,
    timeout: float = LOAD_TIMEOUT_S,
) -> None:
    """Load `path` in a child and evaluate a few tokens, once per file, library and device setting.

    Raises `LocalLLMError` naming the model and llama.cpp's own reason; never a signal here.
    """
    key = library_key()
    if key is None:
        raise BackendUnavailable(f"llama-cpp-python is not installed; fix: {INSTALL_FIX}")
    store = _home(home)
    entry_key = f"{key}:{'gpu' if n_gpu_layers else 'cpu'}"
    loads = _read_cache(store).get("loads")
    cached = loads.get(digest) if isinstance(loads, dict) else None
    if isinstance(cached, dict) and cached.get("key") == entry_key:
        if cached.get("ok"):
            return
        raise LocalLLMError(f"{name}: {cached.get('reason')}")
    done = _run(_python_child("load", os.fspath(path), str(n_gpu_layers)), timeout,
                env=_child_env())  # fmt: skip
    verdict = _judge(done, timeout, what="loading it")
    if verdict.ok:
        reason = ""
    elif done.code is not None and done.code > 0:
        reason = _said_reason(done.out) or f"llama.cpp cannot load it: {_last_error(done.err)}"
    else:
        reason = verdict.reason
    transient = done.code is None or (done.code < 0 and _signal_name(done.code) == "SIGKILL")
    if transient or any(w in reason.lower() for w in ("alloc", "memory")):
        # a time-out, the OOM killer or a full GPU is this moment's trouble, not the file's
        raise LocalLLMError(f"{name}: {reason}")
    _write_cache(store, {"loads": {digest: {"key": entry_key, "ok": verdict.ok,
                                            "reason": reason, "at": time.time()}}})  # fmt: skip
    if not verdict.ok:
        raise LocalLLMError(f"{name}: {reason}")


def _said_reason(out: str) -> str:
    """The reason a load child printed as its last JSON line."""
    for line in reversed(out.strip().splitlines()):
        with contextlib.suppress(ValueError):
            said = json.loads(line)
            if isinstance(said, dict) and isinstance(said.get("reason"), str):
                return said["reason"]
    return ""


# -- build facts ---------------------------------------------------------------------------------


def build_info(timeout: float = 60.0) -> dict[str, Any] | None:
    """llama-cpp-python's version, system info and GPU offload, read in a child; None if absent."""
    if library_key() is None:
        return None
    done = _run(_python_child("info"), timeout, env=_child_env())
    info: dict[str, Any] = {"version": library_version()}
    if done.code == 0:
        with contextlib.suppress(ValueError):
            info.update(json.loads(done.out.strip().splitlines()[-1]))
    else:
        info["error"] = _judge(done, timeout, what="reporting its build").reason
    info["build"] = build_recipe()[0]
    return info


def build_recipe() -> tuple[str, str]:
    """How the installed llama-cpp-python was built: (flavour, CMake arguments). The flavour is
    portable or native when scripts/llamacpp-build installed it (its marker under sys.prefix), else
    unknown (pip's own build: llama.cpp's default, -march=native)."""
    marker = Path(sys.prefix) / "localllm-llamacpp-build"
    with contextlib.suppress(OSError, ValueError):
        _key, *rest = marker.read_text(encoding="utf-8").split(maxsplit=2)
        if rest:
            return rest[0], rest[1].strip() if len(rest) > 1 else ""
    return "unknown", ""


def llamacpp_version() -> str | None:
    """The llama.cpp that llama-cpp-python was built from: its version and commit, as the
    installed llama-config.cmake records them ("0.5.0-dev, commit 0c1e570"). Read from the
    package's file list, nothing imported; None when absent (not installed, or another layout)."""
    try:
        files = importlib.metadata.files("llama-cpp-python") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "llama-config.cmake":
            with contextlib.suppress(OSError, UnicodeDecodeError):
                found = dict(
                    re.findall(
                        r"set\((LLAMA_VERSION|LLAMA_BUILD_COMMIT)\s+([^\s)]+)\)", f.read_text()
                    )
                )
                if "LLAMA_VERSION" in found:
                    commit = found.get("LLAMA_BUILD_COMMIT")
                    return found["LLAMA_VERSION"] + (f", commit {commit}" if commit else "")
    return None


# -- a tiny model, written without any dependency ------------------------------------------------

_F32, _F16, _Q4_0, _Q8_0 = 0, 1, 2, 8
_BLOCK = {_Q4_0: (32, 18), _Q8_0: (32, 34), _F32: (1, 4), _F16: (1, 2)}


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_probe_model(path: Path, *, n_embd: int = 256, n_ff: int = 512, n_layer: int = 2) -> Path:
    """A 2-layer Llama GGUF with Q4_0/Q8_0 weights (the types CPU kernels specialise) and a byte vocab."""
    n_head, n_head_kv = 4, 2
    head_dim = n_embd // n_head
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    n_vocab = len(tokens)
    kv: list[bytes] = []

    def add(key: str, vtype: int, payload: bytes) -> None:
        kv.append(_gguf_string(key) + struct.pack("<I", vtype) + payload)

    u32 = lambda k, v: add(k, 4, struct.pack("<I", v))  # noqa: E731
    add("general.architecture", 8, _gguf_string("llama"))
    add("general.name", 8, _gguf_string("localllm-probe"))
    for key, value in (("context_length", 128), ("embedding_length", n_embd),
                       ("block_count", n_layer), ("feed_forward_length", n_ff),
                       ("attention.head_count", n_head), ("attention.head_count_kv", n_head_kv),
                       ("rope.dimension_count", head_dim)):  # fmt: skip
        u32(f"llama.{key}", value)
    add("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5))
    add("tokenizer.ggml.model", 8, _gguf_string("llama"))
    add("tokenizer.ggml.tokens", 9,
        struct.pack("<IQ", 8, n_vocab) + b"".join(_gguf_string(t) for t in tokens))  # fmt: skip
    add("tokenizer.ggml.scores", 9,
        struct.pack("<IQ", 6, n_vocab) + struct.pack(f"<{n_vocab}f", *([0.0] * n_vocab)))  # fmt: skip
    types = [2, 3, 3] + [6] * 256
    add("tokenizer.ggml.token_type", 9,
        struct.pack("<IQ", 5, n_vocab) + struct.pack(f"<{n_vocab}i", *types))  # fmt: skip
    u32("tokenizer.ggml.unknown_token_id", 0)
    u32("tokenizer.ggml.bos_token_id", 1)
    u32("tokenizer.ggml.eos_token_id", 2)

    rng = random.Random(0)
    tensors: list[tuple[str, tuple[int, ...], int]] = [
        ("token_embd.weight", (n_embd, n_vocab), _Q8_0)
    ]
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (n_embd,), _F32),
            (f"blk.{i}.attn_q.weight", (n_embd, n_embd), _Q4_0),
            (f"blk.{i}.attn_k.weight", (n_embd, n_head_kv * head_dim), _Q4_0),
            (f"blk.{i}.attn_v.weight", (n_embd, n_head_kv * head_dim), _Q8_0),
            (f"blk.{i}.attn_output.weight", (n_embd, n_embd), _Q4_0),
            (f"blk.{i}.ffn_norm.weight", (n_embd,), _F32),
            (f"blk.{i}.ffn_gate.weight", (n_embd, n_ff), _Q4_0),
            (f"blk.{i}.ffn_up.weight", (n_embd, n_ff), _Q4_0),
            (f"blk.{i}.ffn_down.weight", (n_ff, n_embd), _Q8_0),
        ]
    tensors += [
        ("output_norm.weight", (n_embd,), _F32),
        ("output.weight", (n_embd, n_vocab), _Q8_0),
    ]

    def data(shape: tuple[int, ...], ggml_type: int) -> bytes:
        n = 1
        for d in shape:
            n *= d
        if ggml_type == _F32:
            return struct.pack(f"<{n}f", *([1.0] * n))
        per, size = _BLOCK[ggml_type]
        scale = struct.pack("<e", 0.002)
        return b"".join(scale + rng.randbytes(size - 2) for _ in range(n // per))

    infos, blobs, offset = [], [], 0
    for name, shape, ggml_type in tensors:
        infos.append(_gguf_string(name) + struct.pack("<I", len(shape))
                     + b"".join(struct.pack("<Q", d) for d in shape)
                     + struct.pack("<IQ", ggml_type, offset))  # fmt: skip
        blob = data(shape, ggml_type)
        blob += b"\0" * (-len(blob) % 32)
        blobs.append(blob)
        offset += len(blob)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"".join(blobs))
    return path


# -- judging the numbers a child computed ------------------------------------------------------


def logits_disagree(batch: list[float], single: list[float]) -> str:
    """Why two evaluations of the same tokens disagree, or "" when they agree."""
    if not all(math.isfinite(x) for x in batch + single):
        return "the logits are not finite"
    scale = max(1.0, max(abs(x) for x in single))
    diff = max(abs(a - b) for a, b in zip(batch, single))
    kl = _kl(single, batch)
    top = single.index(max(single))
    # another argmax counts unless single's own scores call the two a near-tie
    flipped = single[top] - single[batch.index(max(batch))] > TIE_MARGIN
    if kl > KL_LIMIT or flipped:
        return (f"a prompt batch and token-by-token evaluation differ by {diff:.3g} (scale "
                f"{scale:.3g}; KL {kl:.3g} nats)")  # fmt: skip
    return ""


# How far the two next-token distributions may drift apart (KL(single || batch), nats). llama.cpp
# quantizes activations differently in its matrix-matrix and matrix-vector kernels: over 2,000
# corpus tokens the two paths differ by 0.003 (SmolLM2) and 0.006 (Gemma 3) nats on average
# (bench/llamacpp_agreement.py), and Gemma's first-load tokens on an AVX-512 EPYC by 0.0035 with a
# largest logit difference of 0.77 at scale 23 — which a bound on that difference (1% of the
# scale, the first rule here) refused. A broken kernel (garbage answers) is off by nats.
KL_LIMIT = 0.1
# The batch's top token may differ from token-by-token's where that one's scores put the two within
# this many nats: Gemma 3 270M quantized to Q3_K_M (from F32) was refused on an AVX-512 Xeon at KL
# 0.017 for another argmax at a near-tie; a broken kernel's choice is nats behind.
TIE_MARGIN = 1.0
CHECK_VERSION = 3  # the rules above; cached verdicts (library_key) are per rule


def _kl(p_logits: list[float], q_logits: list[float]) -> float:
    """KL(softmax(p) || softmax(q)) in nats, in plain Python (the child has no numpy to spare)."""

    def log_softmax(xs: list[float]) -> list[float]:
        top = max(xs)
        log_z = top + math.log(sum(math.exp(x - top) for x in xs))
        return [x - log_z for x in xs]

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(lp, lq)))
