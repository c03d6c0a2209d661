"""llama.cpp loads with the planner's placement: `n_gpu_layers`, `tensor_split` and `--cpu-moe`'s
tensor overrides reach llama.cpp (on this CPU build they change nothing, which is how their
structures are checked: a malformed override array would crash the load); the planner's bytes
against llama.cpp's own report; and a load that runs out of GPU memory retries once, smaller."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.types import LoadOptions

from conftest import llamacpp_load_log, need

MiB = 1 << 20
GPU = json.dumps([{"kind": "cuda", "name": "NVIDIA GeForce RTX 4060", "total": "8 GiB"}, {"kind": "cpu"}])


def test_placement_arguments_reach_llama_cpp(default_model_path: Path) -> None:
    need("llama_cpp", "pip install -e '.[dev]'")
    from localllm.backends.base import Piece
    from localllm.backends.llamacpp import LlamaCppRunner

    prompt = [1, 504, 3458, 282, 253, 1345]
    rows = []
    for kw in ({}, {"n_gpu_layers": 16, "tensor_split": (0.25, 0.75), "cpu_moe": 30}):
        r = LlamaCppRunner(default_model_path, n_ctx=256, n_gpu_layers=kw.pop("n_gpu_layers", 0), **kw)
        try:
            rows.append(r.forward([Piece(0, prompt, 1)]).logits[-1])
            if kw:  # the override array: one pattern per layer, then the NULL that ends it
                ov = r._overrides
                assert len(ov) == 31 and ov[30].pattern is None and ov[0].buft
                assert ov[29].pattern == rb"blk\.29\.ffn_(up|down|gate|gate_up)_exps"
                assert list(r._split[:3]) == [0.25, 0.75, 0.0]
        finally:
            r.close()
    np.testing.assert_array_equal(rows[0], rows[1])  # a CPU build: the same numbers


def llamacpp_buffers(path: Path, n_ctx: int, n_gpu_layers: int) -> tuple[float, float]:
    """(model buffer bytes, KV bytes) as llama.cpp logs them loading `path`."""
    log = llamacpp_load_log(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, flash_attn=True)
    # the file's tensors, wherever they went; not CPU_REPACK, a second copy of some matrices in
    # the layout this CPU's kernels want (AVX2 / AVX-512 dependent, made after loading)
    model = [float(size) for buf, size in re.findall(r"(\w+) model buffer size =\s+([\d.]+) MiB", log)
             if buf != "CPU_REPACK"]  # fmt: skip
    kv = [float(m) for m in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", log)]
    assert model and kv, log[-2000:]
    return sum(model) * MiB, sum(kv) * MiB


@pytest.mark.parametrize("which", ["default_model_path", "gemma_model_path"])
def test_planned_bytes_match_llamacpp_with_gpu_layers(which: str, request: pytest.FixtureRequest) -> None:
    """On this CPU build llama.cpp puts every buffer on the CPU whatever `n_gpu_layers` says: the
    planner, asked for the same layer count with no GPU to put them on, agrees with its report
    (weights to 5%, KV exactly), as the ±5% estimate test does for the whole model."""
    need("llama_cpp", "pip install -e '.[dev]'")
    from localllm import devices
    from localllm.memory import plan
    from localllm.model_info import read_model_info

    path = request.getfixturevalue(which)
    info = read_model_info(str(path))
    cpu_only = devices.describe([{"kind": "cpu"}], "test")
    p = plan(info, cpu_only, ctx=1024, gpu_layers="12")
    assert p.gpu_layers == 0 and p.cpu.layers == info.n_layers  # nothing to put them on
    weights, kv = llamacpp_buffers(path, 1024, n_gpu_layers=12)
    print(f"{path.name}: weights ours {p.cpu.weights_bytes / MiB:.2f} MiB, llama.cpp {weights / MiB:.2f}; "
          f"KV ours {p.cpu.kv_bytes / MiB:.2f}, llama.cpp {kv / MiB:.2f}")  # fmt: skip
    assert p.cpu.weights_bytes == pytest.approx(weights, rel=0.05)
    assert p.cpu.kv_bytes == pytest.approx(kv, rel=0.05)


# -- a load that runs out of GPU memory ----------------------------------------------------------


class FakeLoad:
    """A runner that records what it was asked to load and fails, in llama.cpp's words, above
    `fits_up_to` layers on the GPU."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fits_up_to = 31
        self.says = "llama.cpp cannot load it: unable to allocate CUDA0 buffer"

    def __call__(self, path: Any, **kw: Any) -> Any:
        self.calls.append(kw)
        if kw["n_gpu_layers"] > self.fits_up_to:
            raise LocalLLMError(self.says)
        return SimpleNamespace(**kw)

    @property
    def layers(self) -> list[int]:
        return [c["n_gpu_layers"] for c in self.calls]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeLoad:
    """A described 8 GB GPU, a build that offloads, and the recording runner."""
    from localllm.backends import llamacpp, llamacpp_guard

    monkeypatch.setenv("LOCALLLM_DEVICES", GPU)
    monkeypatch.setattr(llamacpp, "gpu_offload", lambda: True)
    monkeypatch.setattr(llamacpp_guard, "check_load", lambda *a, **kw: None)
    load = FakeLoad()
    monkeypatch.setattr(llamacpp, "LlamaCppRunner", load)
    return load


def test_a_load_that_runs_out_of_gpu_memory_retries_once_smaller(fake: FakeLoad, default_model_path: Path) -> None:
    from localllm.backends.llamacpp import open_runner

    fake.fits_up_to = 30  # the card had less room than it said
    r = open_runner(default_model_path, LoadOptions(), name="smollm2", digest="0" * 64)
    assert fake.layers == [31, 30]  # all and the output, then the next smaller plan
    assert r.placement.gpu_layers == 30
    assert r.placement_note == ("GPU memory ran out with 30/30 layers and output on GPU 0, KV on GPU: "
                                "360.0 MiB; loaded with 30/30 layers on GPU 0, KV on GPU: 360.0 MiB "
                                "instead")  # (4 sequences of 4,096: the default --parallel)


def test_a_second_failure_says_both_and_other_errors_are_not_retried(
    fake: FakeLoad, default_model_path: Path
) -> None:
    from localllm.backends.llamacpp import open_runner

    fake.fits_up_to = 3
    with pytest.raises(LocalLLMError) as e:
        open_runner(default_model_path, LoadOptions(), name="smollm2", digest="0" * 64)
    assert fake.layers == [31, 30] and "\n" not in str(e.value)
    assert str(e.value).startswith("llama.cpp cannot load it: unable to allocate CUDA0 buffer (after: 30/30 layers")
    fake.calls.clear()
    fake.says = "llama.cpp cannot load it: unknown model architecture: 'x'"
    with pytest.raises(LocalLLMError, match="unknown model architecture"):
        open_runner(default_model_path, LoadOptions(), name="smollm2", digest="0" * 64)
    assert fake.layers == [31]  # not a memory error: no second try


def test_explicit_placement_and_the_cpu(fake: FakeLoad, default_model_path: Path) -> None:
    from localllm.backends.llamacpp import open_runner

    open_runner(default_model_path, LoadOptions(gpu_layers="12"), name="m", digest="0" * 64)
    open_runner(default_model_path, LoadOptions(device="cpu"), name="m", digest="0" * 64)
    assert fake.layers == [12, 0]
    assert fake.calls[1]["tensor_split"] == () and fake.calls[1]["cpu_moe"] == 0


def test_a_cpu_build_never_plans_for_a_gpu(monkeypatch: pytest.MonkeyPatch, default_model_path: Path) -> None:
    need("llama_cpp", "pip install -e '.[dev]'")
    from localllm.backends.llamacpp import gpu_offload, gpu_placement

    monkeypatch.setenv("LOCALLLM_DEVICES", GPU)  # a GPU is described, and this build cannot use it
    assert gpu_offload() is False and gpu_placement(default_model_path, LoadOptions()) is None
