"""Saved conversations: search, open, rename, delete (asks first), export to Markdown."""

from __future__ import annotations

import re
import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static

from localllm.errors import LocalLLMError
from localllm.tui.dialogs import Ask, Confirm

EMPTY = (
    "No saved conversations yet. To start one: Esc, then Enter on a model in Models opens a chat "
    "(or Ctrl+N in a chat); every chat is saved here as it happens."
)


class ConversationsScreen(Screen):
    DEFAULT_CSS = """
    ConversationsScreen #empty { color: $text-muted; padding: 0 1; height: auto; }
    """
    BINDINGS = [
        Binding("enter", "open", "Open", show=True),
        Binding("ctrl+r", "rename", "Rename"),
        Binding("ctrl+d", "delete", "Delete"),
        Binding("ctrl+x", "export", "Export"),
        Binding("escape", "back", "Back"),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(placeholder="Search titles and messages", id="search")
        yield Static("", id="empty")
        yield DataTable(id="conversations", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Conversations"
        table = self.query_one(DataTable)
        table.add_columns("Title", "Model", "Updated")
        self.refresh_list()
        table.focus()

    def refresh_list(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        search = self.query_one("#search", Input).value.strip() or None
        try:
            convs = self.app.conversations.list(search)
        except LocalLLMError as e:
            self.app.fail(str(e))
            return
        for c in convs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            table.add_row(c.title or "(untitled)", c.model, when, key=str(c.id))
        empty = self.query_one("#empty", Static)
        empty.display = not convs
        if search and not convs:
            empty.update(f"Nothing matches {search!r}. Change the search, or Esc to go back.")
        elif not convs:
            empty.update(EMPTY)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.refresh_list()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(DataTable).focus()

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        return int(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_open(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        conv = self.app.conversations.get(conv_id)
        self.app.pop_screen()
        self.app.open_conversation(conv.model, conv_id)

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_rename(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        conv = self.app.conversations.get(conv_id)

        def done(title: str | None) -> None:
            if title:
                self.app.conversations.rename(conv_id, title)
                self.refresh_list()

        self.app.push_screen(Ask("New title", conv.title or ""), done)

    def action_delete(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        conv = self.app.conversations.get(conv_id)

        def done(yes: bool | None) -> None:
            if yes:
                self.app.conversations.delete(conv_id)
                self.refresh_list()

        self.app.push_screen(Confirm(f"Delete {conv.title or '(untitled)'!r}?"), done)

    def action_export(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        conv = self.app.conversations.get(conv_id)
        slug = re.sub(r"[^a-z0-9]+", "-", (conv.title or "conversation").lower()).strip("-")[:40]
        folder = self.app.store.home / "exports"
        path = folder / f"{conv_id}-{slug or 'conversation'}.md"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(self.app.conversations.export_markdown(conv_id))
        except OSError as e:
            self.app.fail(f"cannot write {path}: {e.strerror or e}")
            return
        self.notify(f"exported to {path}")
