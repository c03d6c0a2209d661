"""Images (issue 34, item 4): a model with its vision projector reads them through llama.cpp's
multimodal library (libmtmd), on every front door; a model without one refuses them in one line.

The fixture (tests/data/vision) is a tiny random Gemma 3 vision model — a SigLIP tower of 2 layers
on 64-pixel images, 4 image positions each, and a 2-layer text model — built with transformers
from a random config (tests/data/vision/build.py) and converted by llama.cpp's own
`convert_hf_to_gguf.py` (and `--mmproj`), from the llama-cpp-python source this project builds.
The oracle is llama.cpp's own way of reading a prompt with images: `mtmd_helper_eval_chunks`.
"""

from __future__ import annotations

import base64
import ctypes
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from localllm.backends.base import MEDIA_MARKER, Piece, media_cut, media_id
from localllm.errors import LocalLLMError
from localllm.models_registry.store import Store
from localllm.types import LoadOptions, Request, SamplingParams

DATA = Path(__file__).resolve().parents[1] / "data" / "vision"
MODEL, PROJECTOR = DATA / "tiny-gemma3-vlm.gguf", DATA / "tiny-gemma3-vlm.mmproj.gguf"
PROMPT = f"<start_of_turn>user\ndescribe {MEDIA_MARKER} please<end_of_turn>\n<start_of_turn>model\n"


def png(w: int, h: int, seed: int = 0) -> bytes:
    """A random RGB PNG."""
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + px[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def runner():  # noqa: ANN201
    from localllm.backends.llamacpp import LlamaCppRunner

    r = LlamaCppRunner(MODEL, n_ctx=256, n_slots=2, n_gpu_layers=0, projector=PROJECTOR)
    yield r
    r.close()


def oracle_logits(text: str, image: bytes) -> np.ndarray:
    """The next-token logits llama.cpp's own helpers give: mtmd_tokenize, then
    mtmd_helper_eval_chunks into a fresh context (no localllm code)."""
    import llama_cpp as lib
    import llama_cpp.mtmd_cpp as m

    from localllm.backends.llamacpp import quiet_llama_log

    quiet_llama_log()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(MODEL).encode(), mp)
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 512, 512, 2, 2
    cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED  # as the runner has it
    ctx = lib.llama_init_from_model(model, cp)
    params = m.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 2, False, False
    mctx = m.mtmd_init_from_file(str(PROJECTOR).encode(), model, params)
    buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
    bitmap = m.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(image), False)
    chunks = m.mtmd_input_chunks_init()
    raw = text.encode()
    given = m.mtmd_input_text(raw, len(raw), True, True)
    try:
        assert m.mtmd_tokenize(mctx, chunks, ctypes.byref(given), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        n_past = lib.llama_pos(0)
        assert m.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    finally:
        m.mtmd_input_chunks_free(chunks)
        m.mtmd_bitmap_free(bitmap)
        m.mtmd_free(mctx)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def test_the_runner_reads_an_image_as_llama_cpp_does(runner) -> None:  # noqa: ANN001
    image = png(32, 32)
    ids = runner.tokenize_media(PROMPT, [image])
    key = -ids[next(i for i, t in enumerate(ids) if t < 0)] - 1
    assert [t for t in ids if t < 0] == [media_id(key, j) for j in range(4)]  # 4 positions (64/16/2)²
    assert runner.tokenize_media(PROMPT, [image]) == ids  # the same image: the same ids
    runner.clear(0)
    ours = runner.forward([Piece(0, ids, 1)]).logits[0]
    np.testing.assert_allclose(ours, oracle_logits(PROMPT, image), atol=1e-4)
    other = runner.tokenize_media(PROMPT, [png(32, 32, seed=1)])
    assert other != ids
    runner.clear(1)
    assert np.abs(runner.forward([Piece(1, other, 1)]).logits[0] - ours).max() > 0.01  # it sees the image


def test_an_image_goes_whole_and_never_gives_logits(runner) -> None:  # noqa: ANN001
    ids = runner.tokenize_media(PROMPT, [png(16, 16, seed=2)])
    first = next(i for i, t in enumerate(ids) if t < 0)
    runner.clear(0)
    with pytest.raises(LocalLLMError, match="split"):
        runner.forward([Piece(0, ids[: first + 2], 0)])
    assert runner.held(0) == 0  # nothing evaluated
    with pytest.raises(LocalLLMError, match="no logits"):
        runner.forward([Piece(0, ids[: first + 4], 1)])
    assert runner.held(0) == 0
    # the scheduler's cut: before the image, or through its end when it begins the step
    assert media_cut(ids, 0, first + 2) == first
    assert media_cut(ids, first, 2) == 4
    assert media_cut(ids, 0, first) == first and media_cut(ids, 0, first + 4) == first + 4


@pytest.mark.parametrize("data, said", [
    (b"GIF89a", "damaged"),
    (b"not an image at all", "PNG, JPEG, GIF or BMP"),
    (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 100_000, 100_000), "100000x100000"),
    (png(8, 8)[:40], "could not be decoded"),
])  # fmt: skip
def test_hostile_images_are_one_line(runner, data: bytes, said: str) -> None:  # noqa: ANN001
    with pytest.raises(LocalLLMError, match=said) as e:
        runner.tokenize_media(PROMPT, [data])
    assert "\n" not in str(e.value)


def test_markers_and_images_must_agree(runner) -> None:  # noqa: ANN001
    with pytest.raises(LocalLLMError, match="places 1 images but 2 were given"):
        runner.tokenize_media(PROMPT, [png(8, 8), png(8, 8, 1)])


@pytest.fixture
def vlm(localllm_home: Path) -> str:
    Store().import_file(MODEL, "vlm")
    return Store().add_projector("vlm", PROJECTOR).name


def chat(images: list[bytes], text: str = "describe") -> Request:
    return Request(messages=({"role": "user", "content": text, "images": images},),
                   sampling=SamplingParams(temperature=0, max_tokens=4))  # fmt: skip


def test_the_engine_counts_an_image_s_positions_and_reuses_them(vlm: str) -> None:
    from localllm.engine import load

    with load(vlm, LoadOptions(backend="llama.cpp", ctx=256, parallel=1)) as llm:
        plain = llm.submit(Request(messages=({"role": "user", "content": "describe"},),
                                   sampling=SamplingParams(temperature=0, max_tokens=4))).wait()  # fmt: skip
        seen = llm.submit(chat([png(32, 32)])).wait()
        # 4 image positions, <start_of_image> and <end_of_image>, and the newline between image and text
        assert seen.usage.prompt_tokens == plain.usage.prompt_tokens + 4 + 2 + 1
        again = llm.submit(chat([png(32, 32)])).wait()
        assert again.text == seen.text and again.usage.cached_tokens >= seen.usage.prompt_tokens - 1
        other = llm.submit(chat([png(32, 32, seed=7)])).wait()
        assert other.usage.cached_tokens < seen.usage.prompt_tokens - 4  # a new image is read again


def test_a_model_without_a_projector_refuses_images_in_one_line(vlm: str, default_model_path: Path) -> None:
    from localllm.engine import load

    with load("smollm2", LoadOptions(backend="llama.cpp", ctx=256, parallel=1)) as llm, \
            pytest.raises(LocalLLMError) as e:  # fmt: skip
        llm.submit(chat([png(8, 8)]))
    assert str(e.value) == ("smollm2:135m-instruct-q4_1 cannot read images here: that needs its vision "
                            "projector (`localllm import --mmproj`) and the llama.cpp backend")  # fmt: skip
    with load(vlm, LoadOptions(backend="torch", ctx=256, parallel=1)) as llm, pytest.raises(LocalLLMError):
        llm.submit(chat([png(8, 8)]))


def test_import_mmproj_and_run_image(vlm: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from localllm.cli import main

    picture = tmp_path / "a.png"
    picture.write_bytes(png(32, 32))
    with pytest.raises(SystemExit) as ex:
        main(["run", vlm, "describe", "--image", str(picture), "--max-tokens", "3", "--temperature", "0",
              "--stats", "--backend", "llama.cpp"])  # fmt: skip
    out = capsys.readouterr()
    assert ex.value.code == 0, out.err
    assert "prompt 25 tokens" in out.err  # 18 of text, 7 of the image
    with pytest.raises(SystemExit) as ex:
        main(["run", "smollm2", "describe", "--image", str(picture)])
    out = capsys.readouterr()
    assert ex.value.code == 1 and out.err.startswith("error: smollm2:135m-instruct-q4_1 cannot read images here")
    with pytest.raises(SystemExit) as ex:
        main(["run", vlm, "describe", "--image", str(tmp_path / "missing.png")])
    assert ex.value.code == 1 and "cannot read the image" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:
        main(["import", str(MODEL), "--name", "bad", "--mmproj", str(MODEL)])
    err = capsys.readouterr().err
    assert ex.value.code == 1 and "is not a vision projector" in err and Store().get("bad") is None
    record = Store().get(vlm)
    assert Store().projector_of(record).read_bytes() == PROJECTOR.read_bytes()
    Store().gc()
    assert Store().projector_of(record).is_file()  # the projector's blob is in use


def test_every_server_route_reads_or_refuses_images(vlm: str, default_model_path: Path) -> None:
    import httpx

    from localllm.server.config import ServerConfig
    from localllm.server.runner import BackgroundServer

    b64 = base64.b64encode(png(32, 32)).decode()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}
    cfg = ServerConfig(port=0, options=LoadOptions(backend="llama.cpp", ctx=256, parallel=2))
    with BackgroundServer(cfg) as server, httpx.Client(base_url=server.url, timeout=120) as c:
        for model, ok in ((vlm, True), ("smollm2", False)):
            asks = [
                ("/v1/chat/completions", {"model": model, "max_tokens": 2, "temperature": 0, "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "describe"}, part]}]}),
                ("/api/chat", {"model": model, "stream": False, "options": {"num_predict": 2}, "messages": [
                    {"role": "user", "content": "describe", "images": [b64]}]}),
                ("/api/generate", {"model": model, "stream": False, "prompt": "describe", "images": [b64],
                                   "options": {"num_predict": 2}}),
            ]  # fmt: skip
            for route, body in asks:
                r = c.post(route, json=body)
                if ok:
                    assert r.status_code == 200, (route, r.text)
                    used = r.json().get("usage", {}).get("prompt_tokens") or r.json().get("prompt_eval_count")
                    assert used >= 7, (route, r.json())  # the image's positions count
                else:
                    assert r.status_code == 400, (route, r.text)
                    said = r.json()["error"]
                    said = said if isinstance(said, str) else said["message"]
                    assert said.endswith("cannot read images here: that needs its vision projector "
                                         "(`localllm import --mmproj`) and the llama.cpp backend"), route  # fmt: skip
        r = c.post("/v1/chat/completions", json={"model": vlm, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})  # fmt: skip
        assert r.status_code == 400 and "not fetched" in r.json()["error"]["message"]


def test_a_draft_model_stands_aside_for_images(vlm: str) -> None:
    """A draft model has no projector: the model's default speculation is off for a prompt with an
    image (the answer is the plain one), and a request that asks for a draft with one is refused."""
    from dataclasses import replace

    from localllm.engine import load

    with load(vlm, LoadOptions(backend="llama.cpp", ctx=256, parallel=1)) as plain:
        want = plain.submit(chat([png(32, 32)])).wait().text
    with load(vlm, LoadOptions(backend="llama.cpp", ctx=256, parallel=1, speculative=f"draft:{vlm}")) as llm:
        got = llm.submit(chat([png(32, 32)])).wait()
        assert got.text == want and (got.speculative is None or got.speculative.drafted == 0)
        with pytest.raises(LocalLLMError, match="a draft model cannot read images"):
            llm.submit(replace(chat([png(32, 32)]), speculative=f"draft:{vlm}"))
