"""`model_check`: well-formed model files whose hyperparameters disagree with their tensors are
refused by `import`, `pull` and `scan` with one line naming the reason, and nothing is registered.

Each broken file is a copy of a tiny Llama (written with `gguf`'s GGUFWriter, the default model's
real tokenizer) with exactly one thing changed. llama.cpp itself, loading some of them in a child
process, aborts the process or fails: that is why the check exists.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from localllm.cli import main
from localllm.errors import GGUFFormatError
from localllm.gguf_file import GGUFFile
from localllm.model_check import check_model, read_checked_info
from localllm.models_registry import pull as pull_mod
from localllm.models_registry.pull import pull
from localllm.models_registry.store import Store

from conftest import need
from fakehub import FakeHub
from ggufs import tokenizer_metadata

N_EMBD, N_HEAD, N_KV, N_FF, N_LAYER, N_CTX = 64, 4, 2, 128, 2, 256
HEAD = N_EMBD // N_HEAD


@dataclass
class Spec:
    """A model file to write: architecture, metadata and tensor shapes (GGUF order: row first)."""

    arch: str
    meta: dict[str, Any]
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def n_vocab(self) -> int:
        return len(self.meta["tokenizer.ggml.tokens"])


def tiny_spec(tok: dict[str, Any]) -> Spec:
    """The tiny Llama of `ggufs.write_tiny_llama`: 2 layers, GQA, tied embeddings."""
    meta: dict[str, Any] = {
        "general.name": "tiny-llama-check",
        "llama.context_length": N_CTX,
        "llama.embedding_length": N_EMBD,
        "llama.block_count": N_LAYER,
        "llama.feed_forward_length": N_FF,
        "llama.attention.head_count": N_HEAD,
        "llama.attention.head_count_kv": N_KV,
        "llama.rope.dimension_count": HEAD,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "general.file_type": 1,
        **{k: (list(v) if not isinstance(v, str | int | float) else v) for k, v in tok.items()},
    }
    spec = Spec("llama", meta)
    spec.tensors["token_embd.weight"] = (N_EMBD, spec.n_vocab)
    for i in range(N_LAYER):
        spec.tensors |= {
            f"blk.{i}.attn_norm.weight": (N_EMBD,),
            f"blk.{i}.attn_q.weight": (N_EMBD, N_HEAD * HEAD),
            f"blk.{i}.attn_k.weight": (N_EMBD, N_KV * HEAD),
            f"blk.{i}.attn_v.weight": (N_EMBD, N_KV * HEAD),
            f"blk.{i}.attn_output.weight": (N_HEAD * HEAD, N_EMBD),
            f"blk.{i}.ffn_norm.weight": (N_EMBD,),
            f"blk.{i}.ffn_gate.weight": (N_EMBD, N_FF),
            f"blk.{i}.ffn_up.weight": (N_EMBD, N_FF),
            f"blk.{i}.ffn_down.weight": (N_FF, N_EMBD),
        }
    spec.tensors["output_norm.weight"] = (N_EMBD,)
    return spec


def write(spec: Spec, path: Path) -> Path:
    """Write `spec` with GGUFWriter; weights are zeros (float16, norms float32)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch=spec.arch)
    for key, v in spec.meta.items():
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            (w.add_int32 if v < 0 else w.add_uint32 if v < 1 << 32 else w.add_uint64)(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, list(v))
    for name, shape in spec.tensors.items():
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor(name, np.zeros(tuple(reversed(shape)), dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tok(default_model_path: Path) -> dict[str, Any]:
    need("gguf", "pip install -e '.[dev]' (the gguf package writes test models)")
    return tokenizer_metadata(default_model_path)


@pytest.fixture
def base(tok: dict[str, Any]) -> Spec:
    return copy.deepcopy(tiny_spec(tok))


# -- the broken copies: one change each, and the reason it must be refused with -----------------


def _set(**kv: Any) -> Callable[[Spec], None]:
    """Set `llama.<key>` values; `__` in a keyword stands for a dot."""
    return lambda s: s.meta.update({f"llama.{k.replace('__', '.')}": v for k, v in kv.items()})


def _shape(name: str, shape: tuple[int, ...]) -> Callable[[Spec], None]:
    return lambda s: s.tensors.update({name: shape})


def _moe(n_expert: int, **kv: Any) -> Callable[[Spec], None]:
    """Replace the FFNs by `n_expert` experts (Mixtral layout), with `llama.*` values `kv`."""

    def change(s: Spec) -> None:
        for i in range(N_LAYER):
            for part in ("gate", "up", "down"):
                del s.tensors[f"blk.{i}.ffn_{part}.weight"]
            s.tensors |= {
                f"blk.{i}.ffn_gate_inp.weight": (N_EMBD, n_expert),
                f"blk.{i}.ffn_gate_exps.weight": (N_EMBD, N_FF, n_expert),
                f"blk.{i}.ffn_up_exps.weight": (N_EMBD, N_FF, n_expert),
                f"blk.{i}.ffn_down_exps.weight": (N_FF, N_EMBD, n_expert),
            }
        _set(**kv)(s)

    return change


def _drop_tokens(n: int) -> Callable[[Spec], None]:
    def change(s: Spec) -> None:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            s.meta[key] = s.meta[key][:-n]

    return change


def _tok(key: str, f: Callable[[Spec], Any]) -> Callable[[Spec], None]:
    return lambda s: s.meta.update({key: f(s)})


def _foreign_arch(s: Spec) -> None:
    s.arch = "qwen2"  # while every hyperparameter stays a llama.* key


def _add_output(shape: Callable[[Spec], tuple[int, ...]]) -> Callable[[Spec], None]:
    return lambda s: s.tensors.update({"output.weight": shape(s)})


SPECIAL_IDS = ["bos", "eos", "unknown", "padding", "seperator", "cls", "mask", "eot", "eom"]

BROKEN: dict[str, tuple[Callable[[Spec], None], str]] = {
    "block_count 0": (_set(block_count=0), "llama.block_count is 0"),
    "block_count above the layers": (
        _set(block_count=3),
        "llama.block_count is 3, but the file has tensors for 2 layers",
    ),
    "a layer beyond block_count": (
        _set(block_count=1),
        r"tensor blk\.1\.\S+ is for layer 1, but llama.block_count is 1",
    ),
    "block_count past llama.cpp's limit": (_set(block_count=600), "600, more than llama.cpp's 512"),
    "context_length 0": (_set(context_length=0), "llama.context_length is 0"),
    "context_length missing": (
        lambda s: s.meta.pop("llama.context_length"),
        "llama.context_length is missing",
    ),
    "head_count 0": (_set(attention__head_count=0), "llama.attention.head_count is 0"),
    "head_count_kv 0": (_set(attention__head_count_kv=0), "llama.attention.head_count_kv is 0"),
    "heads not a multiple of kv heads": (
        _set(attention__head_count_kv=3),
        "head_count 4 is not a multiple of llama.attention.head_count_kv 3",
    ),
    "kv heads per layer, one bad": (
        _set(attention__head_count_kv=[2, 3]),
        "not a multiple of llama.attention.head_count_kv 3 in layer 1",
    ),
    "per-layer array of the wrong length": (
        _set(attention__head_count_kv=[2, 2, 2]),
        "llama.attention.head_count_kv has 3 values for 2 layers",
    ),
    "embedding_length vs token_embd": (
        _set(embedding_length=96),
        "llama.embedding_length is 96 but token_embd.weight has rows of 64",
    ),
    "embedding_length vs attn_q": (
        _shape("blk.1.attn_q.weight", (96, N_HEAD * HEAD)),
        r"blk\.1\.attn_q\.weight has shape \[96, 64\], but llama.embedding_length is 64",
    ),
    "embedding_length vs output": (
        _add_output(lambda s: (48, s.n_vocab)),
        "llama.embedding_length is 64 but output.weight has rows of 48",
    ),
    "output rows vs vocabulary": (
        _add_output(lambda s: (N_EMBD, s.n_vocab - 8)),
        r"output\.weight has shape \[64, \d+\] for \d+ tokens",
    ),
    "key_length vs attn_q": (
        _set(attention__key_length=32, attention__value_length=32, rope__dimension_count=32),
        r"blk\.0\.attn_q\.weight has shape \[64, 64\], which does not follow from .* head size 32",
    ),
    "value_length differs from key_length": (
        _set(attention__value_length=32),
        "llama.attention.key_length 16 and value_length 32 differ",
    ),
    "attn_k vs kv heads": (
        _shape("blk.0.attn_k.weight", (N_EMBD, 48)),
        r"blk\.0\.attn_k\.weight has shape \[64, 48\], which does not follow",
    ),
    "attn_v vs kv heads": (
        _shape("blk.1.attn_v.weight", (N_EMBD, 16)),
        r"blk\.1\.attn_v\.weight has shape \[64, 16\], which does not follow",
    ),
    "feed_forward_length vs ffn tensors": (
        _set(feed_forward_length=256),
        r"blk\.0\.ffn_gate\.weight has shape \[64, 128\], .*feed_forward_length 256",
    ),
    "feed_forward_length per layer, one bad": (
        _set(feed_forward_length=[N_FF, 96]),
        r"blk\.1\.ffn_gate\.weight has shape \[64, 128\], .*feed_forward_length 96",
    ),
    "ffn_down transposed": (
        _shape("blk.0.ffn_down.weight", (N_EMBD, N_FF)),
        r"blk\.0\.ffn_down\.weight has shape \[64, 128\]",
    ),
    "rope dimensions above the head size": (
        _set(rope__dimension_count=32),
        "llama.rope.dimension_count 32 is larger than the attention head size 16",
    ),
    "rope dimensions below the head size (llama)": (
        _set(rope__dimension_count=8),
        "llama.rope.dimension_count 8 differs from the attention head size 16",
    ),
    "unknown rope scaling type": (
        _set(rope__scaling__type="bogus"),
        "llama.rope.scaling.type is 'bogus'",
    ),
    "expert_used_count above expert_count": (
        _set(expert_count=2, expert_used_count=4),
        "llama.expert_used_count 4 is more than llama.expert_count 2",
    ),
    "expert_count without expert_used_count": (
        _moe(4, expert_count=4),
        "llama.expert_count is 4 but llama.expert_used_count is 0 or missing",
    ),
    "expert_count vs expert tensors": (
        _moe(4, expert_count=8, expert_used_count=2),
        r"blk\.0\.ffn_gate_exps\.weight holds 4 experts, llama.expert_count is 8",
    ),
    "expert tensors without expert_count": (
        _moe(4),
        r"blk\.0\.ffn_gate_exps\.weight holds 4 experts, llama.expert_count is 0",
    ),
    "expert_count past llama.cpp's limit": (
        _set(expert_count=2000, expert_used_count=2),
        "llama.expert_count is 2000, more than llama.cpp's 1024",
    ),
    "tokens vs token_embd rows": (
        _drop_tokens(8),
        r"tokenizer.ggml.tokens has (\d+) tokens but token_embd.weight has (\d+) rows",
    ),
    "token_type length": (
        _tok("tokenizer.ggml.token_type", lambda s: s.meta["tokenizer.ggml.token_type"][:-1]),
        r"tokenizer.ggml.token_type has \d+ entries for \d+ tokens",
    ),
    "scores length": (
        _tok("tokenizer.ggml.scores", lambda s: [0.0] * (s.n_vocab - 3)),
        r"tokenizer.ggml.scores has \d+ entries for \d+ tokens",
    ),
    **{
        f"{name} id past the vocabulary": (
            _tok(f"tokenizer.ggml.{name}_token_id", lambda s: s.n_vocab),
            rf"tokenizer.ggml.{name}_token_id \d+ is outside the vocabulary of \d+ tokens",
        )
        for name in SPECIAL_IDS
    },
    "another architecture's key": (
        _tok("gemma3.attention.sliding_window", lambda s: 512),
        "key gemma3.attention.sliding_window belongs to architecture 'gemma3', not 'llama'",
    ),
    "architecture with none of its keys": (
        _foreign_arch,
        r"general.architecture is 'qwen2' but no qwen2\.\* keys are present "
        r"\(its hyperparameters are llama\.\*\)",
    ),
}


def _per_layer(s: Spec) -> None:
    """Per-layer head counts and FFN sizes (as Gemma 3n and OpenELM write them), layer 1 smaller."""
    _set(
        attention__head_count=[N_HEAD, 2],
        attention__head_count_kv=[N_KV, 1],
        feed_forward_length=[N_FF, 96],
    )(s)
    s.tensors |= {
        "blk.1.attn_q.weight": (N_EMBD, 2 * HEAD),
        "blk.1.attn_k.weight": (N_EMBD, HEAD),
        "blk.1.attn_v.weight": (N_EMBD, HEAD),
        "blk.1.attn_output.weight": (2 * HEAD, N_EMBD),
        "blk.1.ffn_gate.weight": (N_EMBD, 96),
        "blk.1.ffn_up.weight": (N_EMBD, 96),
        "blk.1.ffn_down.weight": (96, N_EMBD),
    }


# Consistent variations the check must accept, and architectures it does not know in detail.
GOOD: dict[str, Callable[[Spec], None]] = {
    "as written": lambda s: None,
    "untied output": _add_output(lambda s: (N_EMBD, s.n_vocab)),
    "per-layer arrays": _per_layer,
    "mixture of experts": _moe(4, expert_count=4, expert_used_count=2),
    "explicit head sizes": _set(attention__key_length=HEAD, attention__value_length=HEAD),
    "no-token ids": _tok("tokenizer.ggml.padding_token_id", lambda s: 0xFFFFFFFF),
    "known rope scaling": _set(rope__scaling__type="linear"),
}


def _unknown_arch(s: Spec) -> None:
    """A recurrent-style architecture the check does not know: no heads, odd tensor shapes."""
    s.arch = "futurearch"
    s.meta = {
        ("futurearch." + k.split(".", 1)[1] if k.startswith("llama.") else k): v
        for k, v in s.meta.items()
    }
    s.meta["futurearch.attention.head_count"] = 0
    for i in range(N_LAYER):
        s.tensors[f"blk.{i}.attn_q.weight"] = (N_EMBD, 7 * 16)
        s.tensors[f"blk.{i}.ssm_conv1d.weight"] = (4, 128)


GOOD["unknown architecture, generic checks only"] = _unknown_arch


def import_cli(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["import", str(path)])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def assert_store_empty() -> None:
    store = Store()
    assert store.list() == []
    if store.blobs.exists():
        assert list(store.blobs.iterdir()) == []


@pytest.mark.parametrize("case", list(BROKEN))
def test_import_refuses_an_inconsistent_file(
    case: str, base: Spec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, reason = BROKEN[case]
    change(base)
    path = write(base, tmp_path / "broken.gguf")
    rc, out, err = import_cli(path, capsys)
    assert rc == 1, (out, err)
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: broken.gguf: inconsistent model file: "), err
    assert re.search(reason, err), err
    assert_store_empty()


@pytest.mark.parametrize("case", list(GOOD))
def test_consistent_variations_pass(case: str, base: Spec, tmp_path: Path) -> None:
    GOOD[case](base)
    path = write(base, tmp_path / "good.gguf")
    with GGUFFile(path) as gf:
        check_model(gf)
    info = read_checked_info(str(path))
    assert info.n_layers == N_LAYER and info.architecture == base.arch


def test_the_tiny_test_model_and_real_models_pass(
    tiny_llama: Path,
    default_model_path: Path,
    gemma_model_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for path in (tiny_llama, default_model_path, gemma_model_path):
        with GGUFFile(path) as gf:
            check_model(gf)
    rc, out, err = import_cli(gemma_model_path, capsys)
    assert (rc, err) == (0, ""), err
    assert out.startswith("imported gemma-3-270m-q4_k_m:latest (gemma3, Q4_K_M")
    rc, out, err = import_cli(default_model_path, capsys)
    assert (rc, err) == (0, ""), err
    assert "(llama, Q4_1" in out


def test_refused_in_a_fresh_process_without_signal_or_traceback(
    base: Spec, tmp_path: Path, localllm_home: Path
) -> None:
    _set(block_count=0)(base)
    path = write(base, tmp_path / "zero-layers.gguf")
    p = subprocess.run(
        [sys.executable, "-m", "localllm", "import", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert p.stderr == (
        "error: zero-layers.gguf: inconsistent model file: "
        "llama.block_count is 0: a model needs at least one layer\n"
    )
    assert_store_empty()


# -- what llama.cpp itself does with such files -------------------------------------------------

LOAD_IN_LLAMA_CPP = (
    "import sys\n"
    "import llama_cpp\n"
    "llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)\n"
    "print('loaded')\n"
)


@pytest.mark.parametrize(
    "case",
    [None, "block_count 0", "expert_used_count above expert_count", "unknown rope scaling type"],
)
def test_what_llama_cpp_does_without_the_check(
    case: str | None, base: Spec, tmp_path: Path
) -> None:
    """llama.cpp in a child process: the intact copy loads; the broken ones take the process
    down (GGML_ASSERT → SIGABRT, a negative return code here) or fail. Never exit 0."""
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python)")
    if case is not None:
        BROKEN[case][0](base)
    path = write(base, tmp_path / "m.gguf")
    p = subprocess.run(
        [sys.executable, "-c", LOAD_IN_LLAMA_CPP, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if case is None:
        assert (p.returncode, p.stdout) == (0, "loaded\n"), p.stderr[-2000:]
    else:
        assert p.returncode != 0 and "loaded" not in p.stdout, (p.returncode, p.stderr[-2000:])


# -- pull: the hub's verified bytes are refused and nothing is left behind ----------------------


def test_pull_refuses_an_inconsistent_file(
    base: Spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set(block_count=0)(base)
    path = write(base, tmp_path / "bad-Q4_K_M.gguf")
    with FakeHub() as hub:
        hub.add("org/bad-GGUF", "bad-Q4_K_M.gguf", path)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(pull_mod, "RETRY_DELAYS", (0.05,))
        with pytest.raises(GGUFFormatError, match="llama.block_count is 0"):
            pull("hf.co/org/bad-GGUF")
    store = Store()
    assert store.list() == []
    assert [p.name for p in store.blobs.iterdir()] == []
