"""Quantize from the Models screen, driven by Textual's pilot: the type picker shows each type's
size, progress runs per tensor, the quality report is shown, and `show` keeps it; Escape during
the job cancels it and nothing is registered."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from localllm.models_registry.store import Store
from localllm.tui.app import LocalLLMApp
from localllm.tui.models_screen import ModelsScreen
from localllm.tui.quantize_screen import QuantizeScreen


async def wait_for(pilot, cond, timeout: float = 60.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await pilot.pause(0.05)


def test_quantize_from_the_models_screen(tiny_llama: Path, corpus_dir: Path, tmp_path: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = LocalLLMApp(loader=lambda name, options: None)
        async with app.run_test(size=(120, 40)) as pilot:
            assert isinstance(app.screen, ModelsScreen)
            await pilot.press("q")
            await wait_for(pilot, lambda: isinstance(app.screen, QuantizeScreen))
            screen = app.screen
            options = screen.query_one("#types")
            labels = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
            assert labels[0].startswith("Q4_K_M") and "weights" in labels[0]
            assert any(label.startswith("Q8_0") for label in labels)
            needs = [lab for lab in labels if "needs a calibration text" in lab]
            assert {lab.split()[0] for lab in needs} == {"IQ3_XS", "IQ3_XXS", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS",
                                                          "IQ2_XXS", "IQ1_M", "IQ1_S"}  # fmt: skip
            options.highlighted = [i for i, lab in enumerate(labels) if lab.startswith("Q4_0")][0]
            screen.query_one("#eval").value = str(corpus_dir / "alice.txt")
            screen.query_one("#calibrate").value = str(corpus_dir / "tinyshakespeare.txt")
            screen.start()
            await wait_for(pilot, lambda: screen.job is not None or not screen.running)
            assert screen.job is not None and screen.job.where == "tiny:q4_0"
            report = str(screen.query_one("#report").render())
            assert "KL divergence" in report and "top-1 agreement" in report
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
            names = [r.name for r in Store().list()]
            assert "tiny:q4_0" in names
            table = app.screen.query_one("#models")
            assert "tiny:q4_0" in [str(k.value) for k in table.rows]
        # calibrated: not what the same type gives without the importance matrix
        from localllm.gguf_file import GGUFFile
        from localllm.quant.writer import quantize_file

        plain = quantize_file(tiny_llama, tmp_path / "plain.gguf", "Q4_0").path
        store = Store()
        with GGUFFile(plain) as a, GGUFFile(store.path_of(store.get("tiny:q4_0"))) as b:
            assert any(bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n)) for n in a.tensors)

    asyncio.run(go())


def test_escape_cancels_a_running_quantization(tiny_llama: Path, monkeypatch) -> None:  # noqa: ANN001
    Store().add_file(tiny_llama, "tiny", source="file:x")
    import localllm.quant.writer as qwriter

    real = qwriter.quantized_bytes

    def slow(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.2)
        return real(*a, **kw)

    monkeypatch.setattr(qwriter, "quantized_bytes", slow)

    async def go() -> None:
        app = LocalLLMApp(loader=lambda name, options: None)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("q")
            await wait_for(pilot, lambda: isinstance(app.screen, QuantizeScreen))
            screen = app.screen
            screen.start()
            await wait_for(pilot, lambda: "1/" in str(screen.query_one("#detail").render()))
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.running)
            assert "cancelled" in str(screen.query_one("#detail").render())
            assert [r.name for r in Store().list()] == ["tiny:latest"]

    asyncio.run(go())
