"""The Server screen, driven by Textual's pilot: start in-process, answer a real HTTP request with the
app's own pool, show it in the log and the numbers, copy the URL, stop."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from servers import fake_loader  # noqa: E402

from localllm.pool import ModelPool  # noqa: E402
from localllm.tui.app import LocalLLMApp  # noqa: E402


async def wait_for(pilot, cond, timeout: float = 20.0) -> None:  # noqa: ANN001
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError("timed out")


def test_server_screen_starts_serves_and_stops() -> None:
    from localllm.tui.server_screen import ServerScreen

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(fake_loader(), idle_s=0, fit=None))
        app.settings.set("default_model", "fake")
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.press("f3")
            await wait_for(pilot, lambda: isinstance(app.screen, ServerScreen))
            screen = app.screen
            screen.query_one("#port").value = "0"
            assert "Stopped" in str(screen.query_one("#state").render())
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: app.server is not None and app.server.running)
            url = app.server.url
            body = {"messages": [{"role": "user", "content": "say:served from the app"}]}
            r = await asyncio.to_thread(httpx.post, url + "/v1/chat/completions", json=body, timeout=30)
            assert r.json()["choices"][0]["message"]["content"] == "served from the app"
            table = screen.query_one("#requests")
            await wait_for(pilot, lambda: table.row_count == 1)
            screen.refresh_numbers()
            assert url in str(screen.query_one("#state").render())
            assert "requests 1" in str(screen.query_one("#numbers").render())
            await pilot.press("ctrl+y")
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: app.server is None)
            try:
                await asyncio.to_thread(httpx.get, url + "/health", timeout=2)
                raise AssertionError("the server still answers")
            except httpx.HTTPError:
                pass

    asyncio.run(go())


def test_a_public_bind_without_a_key_is_refused_on_the_screen() -> None:
    from localllm.tui.server_screen import ServerScreen

    async def go() -> None:
        app = LocalLLMApp(pool=ModelPool(fake_loader(), idle_s=0, fit=None))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("f3")
            await wait_for(pilot, lambda: isinstance(app.screen, ServerScreen))
            app.screen.query_one("#host").value = "0.0.0.0"
            app.screen.query_one("#key").value = ""
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            assert app.server is None
            assert any("without an API key" in str(n.message) for n in app._notifications)

    asyncio.run(go())
