"""The offload planner (`memory.plan`) and the device inventory (`localllm.devices`): injected
machines (1× 8 GB, 1× 24 GB, 2× 12 GB, Apple 16 GB unified, none) against real GGUF headers (the
default model, Gemma 3 270M) and header-only 7B / 32B / MoE files written with `gguf`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from localllm import devices as devs
from localllm.errors import LocalLLMError
from localllm.memory import margin_bytes, plan, smaller_plan
from localllm.model_info import ModelInfo, read_model_info
from localllm.types import LoadOptions

from ggufs import write_header_only

GiB = 1 << 30


def machine(*gpus: tuple[str, float, float], cpu: float = 64, cpu_bw: float = 60e9,
            kind: str = "cuda") -> devs.Inventory:  # fmt: skip
    """GPUs as (name, total GiB, free GiB) and the CPU's RAM (GiB)."""
    d: list[dict[str, Any]] = [{"kind": kind, "name": n, "total": int(t * GiB), "free": int(f * GiB)}
                               for n, t, f in gpus]  # fmt: skip
    d.append({"kind": "cpu", "name": "test CPU", "total": int(cpu * GiB), "free": int(cpu * GiB),
              "bandwidth": cpu_bw})  # fmt: skip
    return devs.describe(d, "test")


MACHINES = {
    "8GB": machine(("NVIDIA GeForce RTX 4060", 8, 7.6)),
    "24GB": machine(("NVIDIA GeForce RTX 4090", 24, 23.2)),
    "2x12GB": machine(("NVIDIA GeForce RTX 3060", 12, 11.5), ("NVIDIA GeForce RTX 3060", 12, 11.8)),
    "apple16": devs.describe([{"kind": "metal", "name": "Apple M2", "total": "16 GiB",
                               "free": "12 GiB"}], "test"),  # fmt: skip
    "none": machine(),
}

SHAPES = {  # header-only files: llama 7B (Llama 2), 32B (Qwen2.5-32B's shape), MoE (Qwen3-30B-A3B's)
    "7B": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_kv_head": 32, "n_ff": 11008, "n_vocab": 32000},
    "32B": {"n_layer": 64, "n_embd": 5120, "n_head": 40, "n_kv_head": 8, "n_ff": 27648, "n_vocab": 152064},
    "MoE": {"arch": "qwen3moe", "n_layer": 48, "n_embd": 2048, "n_head": 32, "n_kv_head": 4, "n_ff": 768,
            "n_vocab": 151936, "n_expert": 128, "n_expert_used": 8},
}  # fmt: skip


@pytest.fixture(scope="module")
def infos(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, ModelInfo]:
    root = tmp_path_factory.mktemp("headers")
    out = {name: read_model_info(str(write_header_only(root / f"{name}.gguf", **shape)))
           for name, shape in SHAPES.items()}  # fmt: skip
    out["smollm2"] = read_model_info(str(request.getfixturevalue("default_model_path")))
    out["gemma3"] = read_model_info(str(request.getfixturevalue("gemma_model_path")))
    return out


def test_header_only_files_are_the_sizes_of_real_ones(infos: dict[str, ModelInfo]) -> None:
    """Q4_K_M of Llama 2 7B is 3.8-4.1 GiB, Qwen2.5-32B 18.5 GiB, Qwen3-30B-A3B 17-18.5 GiB
    (these headers put Q6_K in every layer's V and down matrices, Q4_K_M in half: a little more):
    the planner sees real models' bytes (and the sparse files take no disk)."""
    assert 3.8 * GiB < infos["7B"].weights_bytes < 4.2 * GiB
    assert 18 * GiB < infos["32B"].weights_bytes < 20 * GiB
    assert 16.5 * GiB < infos["MoE"].weights_bytes < 18.5 * GiB
    moe = infos["MoE"]
    assert moe.n_experts == 128 and moe.n_experts_used == 8
    assert all(0 < e < w for e, w in zip(moe.expert_bytes, moe.layer_bytes, strict=True))
    for info in infos.values():  # every byte of the file is placed once
        assert len(info.layer_bytes) == info.n_layers
        assert sum(info.layer_bytes) + info.output_bytes + info.embed_bytes == info.weights_bytes


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "7B", "32B", "MoE"])
@pytest.mark.parametrize("where", list(MACHINES))
def test_plans_keep_the_margin(infos: dict[str, ModelInfo], model: str, where: str) -> None:
    info, inv = infos[model], MACHINES[where]
    for ctx in (2048, 8192, 32768):
        p = plan(info, inv, ctx=ctx)
        for s, d in zip(p.gpu_shares, inv.gpus, strict=True):
            limit = d.free_bytes if not d.unified else min(d.free_bytes, d.total_bytes * 3 // 4)
            assert s.total_bytes <= limit - margin_bytes(d), (where, model, ctx, p.text())
            assert s.margin_bytes == margin_bytes(d) >= GiB
        if not inv.gpus:
            assert p.gpu_layers == 0 and p.text() == f"all {info.n_layers} layers on CPU (no GPU)"
        # every layer is somewhere, once; each layer's KV beside it
        assert sum(s.layers for s in p.shares) == info.n_layers
        assert sum(s.kv_bytes for s in p.shares) > 0


def test_small_models_go_wholly_to_the_gpu(infos: dict[str, ModelInfo]) -> None:
    for model in ("smollm2", "gemma3", "7B"):
        p = plan(infos[model], MACHINES["24GB"], ctx=4096)
        assert p.gpu_layers == infos[model].n_layers + 1 and p.fits  # the output layer too
        assert p.cpu.layers == 0 and p.cpu.kv_bytes == 0
        assert p.text().startswith(f"{infos[model].n_layers}/{infos[model].n_layers} layers and output on GPU 0")


def test_a_32b_model_splits_on_a_24gb_card(infos: dict[str, ModelInfo]) -> None:
    assert plan(infos["32B"], MACHINES["24GB"], ctx=8192).gpu_layers == 65  # 8k: all of it
    p = plan(infos["32B"], MACHINES["24GB"], ctx=32768)  # 32k: 4 GiB of KV more
    assert 0 < p.offloaded < 64 and p.fits
    assert p.text().startswith(f"{p.offloaded}/64 layers on GPU 0, {64 - p.offloaded} on CPU, KV on GPU: ")
    one_more = plan(infos["32B"], MACHINES["24GB"], ctx=32768, gpu_layers=str(p.gpu_layers + 1))
    assert not one_more.fits and not one_more.gpu_shares[0].fits  # the planner took the most that fit


@pytest.mark.parametrize("model", ["7B", "32B", "MoE"])
def test_layers_on_the_gpu_are_monotone_in_free_memory(infos: dict[str, ModelInfo], model: str) -> None:
    last = (-1, 0)
    for tenth in range(10, 400, 5):
        free = tenth / 10
        p = plan(infos[model], machine(("card", 40, free)), ctx=8192)
        # more memory: never fewer layers on the GPU, never more experts kept in RAM
        now = (p.gpu_layers, -p.cpu_moe)
        assert now >= last, (free, p.text())
        last = now
    assert last[0] == infos[model].n_layers + 1  # and 40 GB holds them all


def test_moe_experts_leave_the_gpu_before_attention_does(infos: dict[str, ModelInfo]) -> None:
    info = infos["MoE"]
    L = info.n_layers
    seen_partial_moe = False
    for free in range(2, 24):
        p = plan(info, machine(("card", 24, free)), ctx=4096)
        if 0 < p.gpu_layers < L + 1:  # a layer left the GPU: only once every expert is in RAM
            assert p.cpu_moe == L, (free, p.text())
        if p.gpu_layers == L + 1 and 0 < p.cpu_moe < L:
            seen_partial_moe = True
            assert p.text().startswith(f"{L}/{L} layers and output on GPU 0, experts of {p.cpu_moe} of them on CPU")
            assert p.cpu.weights_bytes > sum(info.expert_bytes[: p.cpu_moe])  # (and the embedding)
    assert seen_partial_moe
    # an 8 GB card holds every layer's attention with most experts in RAM
    p = plan(info, MACHINES["8GB"], ctx=4096)
    assert p.gpu_layers == L + 1 and 0 < p.cpu_moe < L and p.fits


def test_two_gpus_share_by_free_memory(infos: dict[str, ModelInfo]) -> None:
    info = infos["32B"]
    p = plan(info, MACHINES["2x12GB"], ctx=4096)
    a, b = p.gpu_shares
    assert a.layers and b.layers and p.fits
    assert p.tensor_split == pytest.approx((10.3 / 20.9, 10.6 / 20.9), abs=0.01)  # free less margins
    assert b.output and not a.output  # llama.cpp's last GPU holds the output layer
    forced = plan(info, MACHINES["2x12GB"], ctx=4096, gpu_layers="40", tensor_split=(0.75, 0.25))
    assert (forced.gpu_shares[0].layers, forced.gpu_shares[1].layers) == (30, 10)
    with pytest.raises(LocalLLMError, match="--tensor-split has 3 parts for 2 GPUs"):
        plan(info, MACHINES["2x12GB"], tensor_split=(0.5, 0.25, 0.25))


def test_apple_unified_memory(infos: dict[str, ModelInfo]) -> None:
    inv = MACHINES["apple16"]
    assert inv.cpu.total_bytes == 16 * GiB  # the RAM the GPU shares
    (gpu,) = inv.gpus
    assert gpu.unified and gpu.bandwidth == 100e9  # the M2's datasheet bandwidth
    p = plan(infos["7B"], inv, ctx=4096)
    assert p.gpu_layers == 33 and p.fits
    assert p.gpu_shares[0].free_bytes == 12 * GiB  # free, capped at three quarters of 16
    assert p.cpu.free_bytes == 12 * GiB - p.gpu_shares[0].total_bytes  # the same RAM, once
    big = plan(infos["32B"], inv, ctx=4096)
    assert not big.fits  # 18 GiB of weights on a 16 GB Mac: does not fit, and says so


def test_all_and_a_number_are_taken_as_asked(infos: dict[str, ModelInfo]) -> None:
    info = infos["32B"]
    p = plan(info, MACHINES["8GB"], ctx=4096, gpu_layers="all")
    assert p.gpu_layers == 65 and not p.fits and p.request == "all"
    p = plan(info, MACHINES["8GB"], ctx=4096, gpu_layers="10")
    assert p.gpu_layers == 10 and p.offloaded == 10 and p.fits
    assert plan(info, MACHINES["8GB"], gpu_layers="0").text() == "all 64 layers on CPU, KV on CPU: 1.0 GiB"


def test_decode_rate_from_bytes_per_token(infos: dict[str, ModelInfo]) -> None:
    info = infos["7B"]
    full = plan(info, MACHINES["24GB"], ctx=4096)
    read = sum(info.layer_bytes) + info.output_bytes  # every weight read once per token
    assert full.gpu_shares[0].read_bytes == read
    assert full.decode_rate == pytest.approx(1008e9 / read, rel=1e-6)
    half = plan(info, MACHINES["24GB"], ctx=4096, gpu_layers="16")
    gpu_read, cpu_read = half.gpu_shares[0].read_bytes, half.cpu.read_bytes
    assert gpu_read + cpu_read == read
    assert half.decode_rate == pytest.approx(1 / (gpu_read / 1008e9 + cpu_read / 60e9), rel=1e-6)
    assert half.decode_rate < full.decode_rate
    moe = plan(infos["MoE"], MACHINES["24GB"], ctx=4096)  # 8 of 128 experts read per token
    assert moe.gpu_shares[0].read_bytes < infos["MoE"].weights_bytes / 5
    unknown = plan(info, machine(("a card with no datasheet", 24, 23)), ctx=4096)
    assert unknown.decode_rate is None


def test_smaller_plan_after_a_failed_load(infos: dict[str, ModelInfo]) -> None:
    info, inv = infos["32B"], MACHINES["24GB"]
    first = plan(info, inv, ctx=4096)
    second = smaller_plan(info, inv, first, ctx=4096)
    assert second is not None and second.gpu_layers < first.gpu_layers
    gpu = second.gpu_shares[0]
    assert gpu.total_bytes <= gpu.free_bytes - 2 * margin_bytes(inv.gpus[0])  # twice the margin
    tiny = plan(infos["smollm2"], inv, ctx=4096)  # margins doubled still hold it all: one layer fewer
    assert smaller_plan(infos["smollm2"], inv, tiny, ctx=4096).gpu_layers == tiny.gpu_layers - 1
    assert smaller_plan(info, MACHINES["none"], plan(info, MACHINES["none"])) is None


def test_index_entries_without_layer_bytes_spread_the_weights(infos: dict[str, ModelInfo]) -> None:
    """A store index written before per-layer bytes were kept still plans (evenly)."""
    d = infos["7B"].to_dict()
    for k in ("layer_bytes", "expert_bytes", "output_bytes", "embed_bytes"):
        d.pop(k)
    old = ModelInfo.from_dict(d)
    exact, even = plan(infos["7B"], MACHINES["8GB"]), plan(old, MACHINES["8GB"])
    assert abs(exact.gpu_layers - even.gpu_layers) <= 2
    assert ModelInfo.from_dict(infos["MoE"].to_dict()) == infos["MoE"]  # kept through the index


# -- the device inventory ------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "says"), [
    ({}, "a non-empty JSON list"),
    ([], "a non-empty JSON list"),
    ([{"kind": "tpu", "total": 1}], "kind must be one of cuda, rocm, metal, vulkan, cpu"),
    ([{"kind": "cuda"}], "device 0: total (bytes) is missing"),
    ([{"kind": "cuda", "total": "8 GiB", "free": "9 GiB"}], "is more than total"),
    ([{"kind": "cuda", "total": "eight"}], "'eight' is not a size"),
    ([{"kind": "cuda", "total": True}], "a size is a number of bytes"),
    ([{"kind": "cuda", "total": -5}], "is not a size a device has"),
    ([{"kind": "cuda", "total": 8e9, "bandwidth": "fast"}], "'fast' is not a size"),
    ([{"kind": "cpu", "total": 1}, {"kind": "cpu", "total": 1}], "one cpu entry at most"),
    (["cuda"], "device 0 is not an object"),
])  # fmt: skip
def test_bad_descriptions_are_one_line(data: Any, says: str) -> None:
    with pytest.raises(LocalLLMError) as e:
        devs.describe(data, "x.json")
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("x.json")


def test_descriptions_read_units_and_number_gpus_in_order() -> None:
    inv = devs.describe([
        {"kind": "cuda", "name": "NVIDIA H100 PCIe", "total": "80 GB", "free": 79e9},
        {"kind": "vulkan", "name": "Radeon", "total": "16GiB", "bandwidth": "512 GB/s"},
        {"kind": "cpu", "total": "128 GiB", "free": "100 GiB", "bandwidth": 200e9},
    ], "test")  # fmt: skip
    h100, radeon = inv.gpus
    assert (h100.id, h100.total_bytes, h100.free_bytes, h100.bandwidth) == ("cuda:0", 80e9, 79e9, 2000e9)
    assert (radeon.id, radeon.label, radeon.free_bytes, radeon.bandwidth) == ("vulkan:1", "GPU 1", 16 * GiB, 512e9)
    assert (inv.cpu.total_bytes, inv.cpu.bandwidth) == (128 * GiB, 200e9)
    assert devs.known_bandwidth("NVIDIA GeForce RTX 4070 Ti SUPER") == 504e9  # longest name first
    assert devs.known_bandwidth("NVIDIA GeForce RTX 40700") is None


def test_the_environment_and_a_file_describe_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = json.dumps([{"kind": "cuda", "name": "NVIDIA GeForce RTX 3090", "total": "24 GiB"}])
    monkeypatch.setenv(devs.ENV, text)
    inv = devs.inventory()
    assert [g.name for g in inv.gpus] == ["NVIDIA GeForce RTX 3090"] and inv.source == devs.ENV
    f = tmp_path / "machine.json"
    f.write_text(text)
    monkeypatch.setenv(devs.ENV, str(f))
    assert devs.inventory().source == str(f)
    assert devs.inventory(f).gpus[0].bandwidth == 936e9
    monkeypatch.setenv(devs.ENV, "[not json")
    with pytest.raises(LocalLLMError, match="LOCALLLM_DEVICES is not JSON"):
        devs.inventory()
    with pytest.raises(LocalLLMError, match="cannot read the device description"):
        devs.inventory(tmp_path / "missing.json")
    monkeypatch.setenv(devs.ENV, '[{"kind": "cpu"}]')  # this machine without its GPUs
    inv = devs.inventory()
    assert not inv.gpus and inv.cpu.total_bytes > 0 and inv.cpu.bandwidth


def test_this_machine_is_detected() -> None:
    inv = devs.detect()
    assert inv.source == "detected" and inv.cpu.total_bytes >= inv.cpu.free_bytes > 0
    assert inv.cpu.bandwidth and inv.cpu.bandwidth > 1e8  # measured, whatever the machine


# -- the options that carry a placement --------------------------------------------------------


@pytest.mark.parametrize(("kw", "says"), [
    ({"gpu_layers": "most"}, "--gpu-layers must be auto, all or a number"),
    ({"gpu_layers": "-3"}, "--gpu-layers must be auto, all or a number"),
    ({"tensor_split": "a,b"}, "--tensor-split takes proportions per GPU"),
    ({"tensor_split": "0,0"}, "non-negative proportions"),
    ({"cpu_moe": -1}, "--cpu-moe takes a number of layers"),
])  # fmt: skip
def test_placement_options_are_checked(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(LocalLLMError, match=says):
        LoadOptions(**kw)


def test_placement_options_round_trip_and_only_llama_cpp_has_them() -> None:
    from localllm import backends
    from localllm.errors import Unsupported

    o = LoadOptions(gpu_layers="ALL", tensor_split="3,1", cpu_moe=4)
    assert (o.gpu_layers, o.tensor_split, o.cpu_moe) == ("all", "0.75,0.25", 4)
    assert o.placement == {"gpu_layers": "all", "tensor_split": (0.75, 0.25), "cpu_moe": 4}
    assert LoadOptions.from_dict(o.to_dict()) == o
    backends.check_options(o, backends.get("llama.cpp").capabilities, "llama.cpp")
    with pytest.raises(Unsupported, match="the torch backend has no layer placement .*--backend llama.cpp"):
        backends.check_options(LoadOptions(gpu_layers="10"), backends.get("torch").capabilities, "torch")
