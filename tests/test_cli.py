"""The `localllm` command: outputs, exit codes, one-line errors, and a light start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.cli import main
from localllm.models_registry.store import Store

HEAVY = ("torch", "llama_cpp", "textual", "fastapi", "transformers")


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def run_process(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=120, **kw
    )


def assert_one_line_error(rc: int, out: str, err: str, text: str) -> None:
    assert rc == 1, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and text in err, err
    assert "Traceback" not in err + out


@pytest.mark.parametrize("args", [["--help"], ["list"], ["--version"]])
def test_light_start_imports_nothing_heavy(args: list[str], tiny_llama: Path) -> None:
    """`localllm --help` and `list` import neither torch, llama_cpp nor textual."""
    Store().add_file(tiny_llama, "tiny", source="x")
    code = (
        "import sys\n"
        f"sys.argv = ['localllm', *{args!r}]\n"
        "from localllm.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stdout, p.stdout[-500:]


def test_version_names_the_engines_and_the_llama_cpp_recipe(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata
    import platform

    from localllm import __version__

    rc, out, err = run(["--version"], capsys)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"localllm {__version__} (Python {platform.python_version()})"
    llama = importlib.metadata.version("llama-cpp-python")  # the dev install has both engines
    assert f"torch {importlib.metadata.version('torch')}" in lines
    # the recipe scripts/llamacpp-build wrote beside this venv (scripts/setup builds it)
    marker = (Path(sys.prefix) / "localllm-llamacpp-build").read_text().split(maxsplit=2)
    # the llama.cpp it vendors, as its CMake package file says (installed beside the package)
    [config] = Path(sys.prefix).glob("lib/python3*/site-packages/lib/cmake/llama/llama-config.cmake")
    cmake = dict(re.findall(r"set\((LLAMA_VERSION|LLAMA_BUILD_COMMIT)\s+(\S+?)\)", config.read_text()))
    source = f"llama.cpp {cmake['LLAMA_VERSION']}, commit {cmake['LLAMA_BUILD_COMMIT']}"
    assert lines[1] == (f"llama-cpp-python {llama}, {source} "
                        f"(llama.cpp build: {marker[1]}, by scripts/llamacpp-build)")  # fmt: skip
    if len(marker) > 2:
        assert lines[2] == f"  CMake: {marker[2].strip()}"
    # a llama-cpp-python pip built on its own: no marker; a layout without the CMake file
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "files", lambda dist: [])
    assert f"llama-cpp-python {llama} (llama.cpp build: pip's own, llama.cpp's default -march=native)" in (
        run(["--version"], capsys)[1].splitlines())
    # an empty or garbled marker is the same as none
    (tmp_path / "localllm-llamacpp-build").write_text("")
    assert "pip's own" in run(["--version"], capsys)[1]


def test_list_empty_and_json(capsys: pytest.CaptureFixture[str], tiny_llama: Path) -> None:
    rc, out, _ = run(["list"], capsys)
    assert rc == 0 and "No local models" in out
    assert run(["list", "--json"], capsys)[1] == "[]\n"
    Store().add_file(tiny_llama, "tiny", source="file:/somewhere")
    rc, out, _ = run(["list"], capsys)
    header, row = out.splitlines()
    assert header.split() == ["NAME", "ARCH", "PARAMS", "QUANT", "SIZE", "CONTEXT", "SOURCE"]
    assert row.split()[:4] == ["tiny:latest", "llama", "3.2M", "F16"]
    [entry] = json.loads(run(["list", "--json"], capsys)[1])
    assert entry["name"] == "tiny:latest" and entry["architecture"] == "llama"
    assert entry["digest"].startswith("sha256:") and entry["context_length"] == 256
    assert set(entry) == {"name", "digest", "size", "source", "reference", "added", "architecture",
                          "parameters", "quant", "context_length", "projector"}  # fmt: skip
    assert entry["projector"] is None  # no vision projector


def test_show_default_model_offline(
    capsys: pytest.CaptureFixture[str], default_model_path: Path
) -> None:
    rc, out, err = run(["show", "smollm2"], capsys)
    assert rc == 0, err
    assert "smollm2:135m-instruct-q4_1" in out and "Q4_1" in out and "llama" in out
    assert "Memory at context 4,096, KV cache f16" in out and "fits" in out
    assert "<|im_start|>" in out  # the chat template
    data = json.loads(
        run(["show", "smollm2", "--json", "--ctx", "2048", "--kv-cache", "q8_0"], capsys)[1]
    )
    mem = data["memory"]
    assert (mem["ctx"], mem["type_k"], mem["type_v"]) == (2048, "q8_0", "q8_0")
    assert mem["total_bytes"] == mem["weights_bytes"] + mem["kv_bytes"] + mem["compute_bytes"]
    assert data["info"]["n_layers"] == 30 and data["chat_template"].startswith("{% for message")
    # what the registry says of the backend, the model's sampling defaults, the template used
    backend = data["backend"]
    assert backend["name"] == "llama.cpp" and "q8_0" in backend["capabilities"]["kv_cache_types"]
    assert backend["capabilities"]["grammar"] is True and backend["capabilities"]["speculative"] == ["off", "lookup", "draft"]
    assert data["sampling_defaults"] == {"values": {"temperature": 0.2, "top_p": 0.9},
                                         "source": "catalog"}  # fmt: skip
    assert data["template"] == {"origin": "model file", "note": None}
    assert "can do          KV f16" in out and "; constrained decoding" in out
    assert "temperature 0.2, top_p 0.9 (from the catalog)" in out
    assert "Chat template (model file):" in out
    huge = json.loads(run(["show", "smollm2", "--json", "--ctx", str(1 << 40)], capsys)[1])
    assert huge["memory"]["fits"] is False
    rc, out, _ = run(["show", "smollm2", "--ctx", str(1 << 40)], capsys)
    assert "does NOT fit" in out


def test_show_plans_for_a_described_machine(
    capsys: pytest.CaptureFixture[str], default_model_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`show --devices FILE.json`: "will it fit on this card?", with the plan llama.cpp would load."""
    card = tmp_path / "card.json"
    card.write_text(json.dumps([{"kind": "cuda", "name": "NVIDIA GeForce RTX 4090", "total": "24 GiB",
                                 "free": "23 GiB"}, {"kind": "cpu", "total": "32 GiB", "bandwidth": "50 GB/s"}]))
    rc, out, err = run(["show", "smollm2", "--devices", str(card)], capsys)
    assert rc == 0, err
    assert f"Devices (described in {card}):" in out
    assert "GPU 0           NVIDIA GeForce RTX 4090: 23.0 GiB free of 24.0 GiB, 1008 GB/s" in out
    assert "Placement (llama.cpp, --gpu-layers auto): 30/30 layers and output on GPU 0, KV on GPU: 90.0 MiB" in out
    assert "as llama.cpp flags: --gpu-layers 31; expected decode at most" in out
    # a card with room for part of it: 1 GiB kept free, so 1.15 GiB leaves 150 MiB for layers
    small = tmp_path / "small.json"
    small.write_text(json.dumps([{"kind": "cuda", "name": "a small card", "total": "1.15 GiB"}]))
    data = json.loads(run(["show", "smollm2", "--devices", str(small), "--json"], capsys)[1])
    plan = data["memory"]["plan"]
    assert 0 < plan["gpu_layers"] < 30 and plan["fits"] and data["memory"]["fits"]
    assert plan["text"].startswith(f"{plan['gpu_layers']}/30 layers on GPU 0, {30 - plan['gpu_layers']} on CPU")
    assert plan["decode_rate"] is None  # an unknown card's bandwidth: no rate rather than a guess
    assert data["devices"]["source"] == str(small) and data["devices"]["devices"][0]["name"] == "a small card"
    gpu = plan["shares"][0]
    assert gpu["total_bytes"] <= gpu["free_bytes"] - gpu["margin_bytes"]
    # forced past what fits: said, and the same through LOCALLLM_DEVICES
    monkeypatch.setenv("LOCALLLM_DEVICES", small.read_text())
    rc, out, _ = run(["show", "smollm2", "--gpu-layers", "all"], capsys)
    assert "Devices (described in LOCALLLM_DEVICES):" in out and "DOES NOT FIT" in out and "does NOT fit" in out
    rc, out, err = run(["show", "smollm2", "--gpu-layers", "most"], capsys)
    assert_one_line_error(rc, out, err, "--gpu-layers must be auto, all or a number")
    rc, out, err = run(["show", "smollm2", "--devices", str(tmp_path / "none.json")], capsys)
    assert_one_line_error(rc, out, err, "cannot read the device description")


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["show", "nosuchmodel"], "not in the store nor in the catalog"),
        (["show", "../etc/passwd"], "model name"),
        (["show", "smollm2", "--kv-cache", "q3"], "unknown KV cache type"),
        (["show", "smollm2", "--ctx", "0"], "(--ctx) must be a whole number of at least 16"),
        (["rm", "nosuchmodel", "--yes"], "not in the store"),
        (["import", "/nonexistent/file.gguf"], "no such file"),
    ],
)
def test_user_errors_are_one_line(args: list[str], text: str, capsys: pytest.CaptureFixture[str],
                                  default_model_path: Path) -> None:  # fmt: skip
    assert_one_line_error(*run(args, capsys), text)


@pytest.mark.parametrize(
    "args", [["show"], ["nosuchcommand"], ["list", "--bogus"], ["show", "x", "--ctx", "many"]]
)
def test_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(args, capsys)
    assert rc == 2 and "Traceback" not in err and err.strip()


def test_import_hostile_file_changes_nothing(tmp_path: Path, tiny_llama: Path, localllm_home: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    Store().add_file(tiny_llama, "kept", source="x")
    index = (localllm_home / "index.json").read_bytes()
    blobs = sorted(os.listdir(localllm_home / "blobs"))
    data = bytearray(tiny_llama.read_bytes())
    data[20:28] = (1 << 63).to_bytes(8, "little")  # metadata count 2^63
    bad = tmp_path / "evil.gguf"
    bad.write_bytes(bytes(data))
    assert_one_line_error(*run(["import", str(bad)], capsys), "evil.gguf: not a valid GGUF file")
    assert (localllm_home / "index.json").read_bytes() == index
    assert sorted(os.listdir(localllm_home / "blobs")) == blobs


def test_import_show_rm(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "My Model.Q8_0.gguf"
    os.link(tiny_llama, src)
    rc, out, err = run(["import", str(src)], capsys)
    assert rc == 0 and out.startswith("imported my-model.q8_0:latest"), err
    rc, out, err = run(["import", str(src), "--name", "other:v2"], capsys)
    assert rc == 0 and "other:v2" in out
    assert_one_line_error(*run(["import", str(src), "--name", "../x"], capsys), "model name")
    rc, out, _ = run(["show", "other:v2"], capsys)
    assert rc == 0 and "tiny-llama-test" in out and "none in the file" not in out
    # without --yes and without a terminal, rm refuses rather than guessing
    assert_one_line_error(*run(["rm", "other:v2"], capsys), "--yes")
    assert run(["rm", "other:v2", "--yes"], capsys)[:2] == (0, "removed other:v2\n")
    assert src.exists()  # the user's own file is never touched
    assert [r.name for r in Store().list()] == ["my-model.q8_0:latest"]


def test_rm_resolves_catalog_names(
    capsys: pytest.CaptureFixture[str], default_model_path: Path
) -> None:
    assert run(["show", "smollm2", "--json"], capsys)[0] == 0
    assert run(["rm", "smollm2", "-y"], capsys)[:2] == (0, "removed smollm2:135m-instruct-q4_1\n")
    assert Store().list() == []
    assert default_model_path.exists()


def test_interrupt_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(self: Store) -> list:
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "list", interrupted)
    rc, out, err = run(["list"], capsys)
    assert rc == 130 and "Traceback" not in err


def test_console_script_end_to_end(default_model_path: Path) -> None:
    p = run_process(["show", "smollm2", "--json"])
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["name"] == "smollm2:135m-instruct-q4_1"
    p = run_process(["show", "nosuchmodel"])
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_show_says_which_template_a_model_without_one_gets(
    tmp_path: Path, default_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ggufs import tokenizer_metadata, write_tiny_llama

    tok = {k: v for k, v in tokenizer_metadata(default_model_path).items()
           if k != "tokenizer.chat_template"}  # fmt: skip
    Store().add_file(write_tiny_llama(tmp_path / "bare.gguf", tok), "bare", source="test")
    rc, out, err = run(["show", "bare"], capsys)
    assert rc == 0, err
    assert "Chat template: plain text — the file has no chat template" in out
    assert "sampling        the global defaults" in out
    data = json.loads(run(["show", "bare", "--json"], capsys)[1])
    assert data["chat_template"] is None and data["template"]["origin"] == "plain text"
    assert "no chat template" in data["template"]["note"]
    assert data["sampling_defaults"] == {"values": {}, "source": "global"}


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--backend", "llama.cpp", "--evict", "h2o:64"], "the llama.cpp backend has no h2o eviction (--evict) (it has: "
                                "none); the torch backend has it (--backend torch)"),
        (["--evict", "lru"], "bad --evict 'lru'"),
        (["--backend", "llama.cpp", "--speculative", "self"], "the llama.cpp backend has no speculative mode 'self' (it "
                                "has: off, lookup, draft); the torch backend has it (--backend torch)"),
        (["--backend", "llama.cpp", "--kv-cache", "int8"], "the llama.cpp backend has no int8 KV cache"),
        (["--backend", "llama.cpp", "--kv-cache", "k=q8_0,v=int4"], "the llama.cpp backend has no int4 KV cache (it has: "
                                          "f16, f32, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1); "
                                          "the torch backend has it (--backend torch)"),
        (["--backend", "vllm"], "unknown backend 'vllm' (choose from auto, llama.cpp"),
        (["--backend", "torch", "--kv-cache", "q8_0"], "the torch backend has no q8_0 KV cache"),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
        (["--top-p", "7"], "top_p must be in (0, 1]"),
        (["--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json"),
    ],
)
def test_run_refuses_what_the_backend_cannot_do_before_loading(
    args: list[str], text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The engine's checks refuse in one line; nothing is loaded (not even the model's name)."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = [str(schema) if a == "SCHEMA" else a for a in args]
    from localllm.models_registry import catalog

    def no_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a refused run must not look the model up")

    monkeypatch.setattr(catalog, "ensure_local", no_load)
    assert_one_line_error(*run(["run", "smollm2", "hi", *args], capsys), text)


def test_every_backend_flag_lists_the_registry() -> None:
    from localllm import backends

    p = run_process(["run", "--help"], env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0
    assert f"Backend: {', '.join(backends.names())}" in " ".join(p.stdout.split())


def test_run_says_the_template_note_once(tmp_path: Path, default_model_path: Path) -> None:
    """A model file without a chat template: `run` says which format it uses instead, on stderr."""
    from ggufs import tokenizer_metadata, write_tiny_llama

    tok = {k: v for k, v in tokenizer_metadata(default_model_path).items()
           if k != "tokenizer.chat_template"}  # fmt: skip
    Store().add_file(write_tiny_llama(tmp_path / "bare.gguf", tok), "bare", source="test")
    p = run_process(["run", "bare", "hi", "--max-tokens", "2", "--temperature", "0"])
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("note: the file has no chat template") == 1, p.stderr
    p = run_process(["run", "bare", "hi", "--max-tokens", "2", "--json"])
    assert p.returncode == 0 and "note:" not in p.stderr, p.stderr
    assert json.loads(p.stdout)["model"] == "bare:latest"
