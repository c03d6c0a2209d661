"""Bench from the Models screen, driven by Textual's pilot: `b` opens it on the selected model,
Bench fills the table with each level's numbers and the ceiling, Recommend fills it with every
local model's setting, Escape during a run stops it."""

from __future__ import annotations

from pathlib import Path

from test_app import wait_for

from localllm.models_registry.store import Store
from localllm.tui.app import LocalLLMApp
from localllm.tui.bench_screen import BenchScreen
from localllm.tui.models_screen import ModelsScreen


def cells(screen: BenchScreen) -> list[list[str]]:
    table = screen.query_one("#results")
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def test_bench_and_recommend_from_the_models_screen(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = LocalLLMApp(loader=lambda name, options: None)
        async with app.run_test(size=(120, 40)) as pilot:
            assert isinstance(app.screen, ModelsScreen)
            await pilot.press("b")
            await wait_for(pilot, lambda: isinstance(app.screen, BenchScreen), timeout=60)
            screen = app.screen
            assert screen.model == "tiny:latest"
            screen.start_bench()
            await wait_for(pilot, lambda: not screen.running, timeout=120)
            assert screen.report is not None, str(screen.query_one("#detail").render())
            rows = cells(screen)
            assert [r[0] for r in rows] == ["1", "2"]
            assert all("% of" in r[-1] for r in rows) and float(rows[0][3]) > 0
            screen.start_recommend()
            await wait_for(pilot, lambda: not screen.running, timeout=300)
            assert screen.recommendation is not None, str(screen.query_one("#detail").render())
            rows = cells(screen)
            assert rows and all(r[1] == "tiny:latest" for r in rows)
            assert rows[0][0] == "1." and "best: tiny:latest" in str(screen.query_one("#detail").render())
            # Escape while running stops it, and the next Escape closes
            screen.start_bench()
            await pilot.pause(0.05)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.running, timeout=120)
            assert "cancelled" in str(screen.query_one("#detail").render())
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen), timeout=60)

    import asyncio

    asyncio.run(go())
