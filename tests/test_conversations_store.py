"""The conversation store: a message tree in SQLite (WAL) that survives a kill mid-stream."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from localllm import conversations as conv_mod
from localllm.conversations import (
    ConversationNotFound,
    Conversations,
    ConversationStoreError,
    MessageNotFound,
    default_db_path,
)
from localllm.errors import LocalLLMError


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that ticks one second per reading, so `updated` orders never tie."""
    ticks = itertools.count(1_000_000)
    monkeypatch.setattr(conv_mod, "time", SimpleNamespace(time=lambda: float(next(ticks))))


@pytest.fixture
def store() -> Conversations:
    with Conversations() as s:
        yield s


def assert_one_line(e: pytest.ExceptionInfo[BaseException], path: Path) -> None:
    assert isinstance(e.value, LocalLLMError)
    text = str(e.value)
    assert "\n" not in text and str(path) in text, text


def raw_count(path: Path, sql: str, *args: object) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, args).fetchone()[0]
    finally:
        conn.close()


# -- conversations ---------------------------------------------------------------------------


def test_lives_in_the_store_folder(localllm_home: Path) -> None:
    assert default_db_path() == localllm_home / "conversations.db"
    with Conversations() as s:
        assert s.path == localllm_home / "conversations.db"
    assert s.path.is_file()  # the folder was created on the way


def test_wal_mode_and_schema_version(store: Conversations) -> None:
    conn = sqlite3.connect(store.path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == conv_mod.SCHEMA_VERSION >= 1
    finally:
        conn.close()


def test_create_list_rename_delete(store: Conversations, clock: None) -> None:
    a = store.create("smollm2:latest", title="first", settings={"sampling": {"temperature": 0.2}})
    b = store.create("smollm2:latest", title="second")
    c = store.create("gemma3:270m")
    assert [x.id for x in store.list()] == [c.id, b.id, a.id]  # newest first
    assert store.get(a.id).settings == {"sampling": {"temperature": 0.2}}
    assert c.title is None and c.current_leaf is None and store.branch(c.id) == []

    store.add_message(a.id, "user", "hello")  # activity moves a conversation to the top
    assert [x.id for x in store.list()] == [a.id, c.id, b.id]
    assert [x.id for x in store.list(limit=2)] == [a.id, c.id]

    renamed = store.rename(b.id, "  a\tnew\nname ")
    assert renamed.title == "a new name" and store.get(b.id).title == "a new name"
    assert [x.id for x in store.list()] == [a.id, c.id, b.id]  # a rename keeps the order

    assert raw_count(store.path, "SELECT count(*) FROM messages WHERE conversation_id = ?", a.id)
    store.delete(a.id)
    assert [x.id for x in store.list()] == [c.id, b.id]
    assert raw_count(store.path, "SELECT count(*) FROM messages") == 0  # cascaded
    with pytest.raises(ConversationNotFound) as e:
        store.get(a.id)
    assert isinstance(e.value, KeyError) and str(e.value) == f"no conversation with id {a.id}"
    for call in (lambda: store.delete(a.id), lambda: store.rename(a.id, "x")):
        with pytest.raises(ConversationNotFound):
            call()


def test_search_titles_and_messages(store: Conversations, clock: None) -> None:
    pct = store.create("m", title="Discount of 100% off")
    thousand = store.create("m", title="1000 reasons")
    snake = store.create("m", title="snake_case names")
    plain = store.create("m", title="Über Straße")
    body = store.create("m", title="nothing here")
    store.add_message(body.id, "user", "Tell me about PYTHON decorators")

    def ids(q: str) -> list[int]:
        return [x.id for x in store.list(search=q)]

    assert ids("100%") == [pct.id]  # % is literal, not a wildcard
    assert ids("100") == [thousand.id, pct.id]
    assert ids("e_c") == [snake.id]  # so is _
    assert ids("python") == [body.id]  # message text, case-insensitively
    assert ids("DISCOUNT") == [pct.id]
    assert ids("über") == [plain.id] and ids("STRASSE") == [plain.id]  # beyond ASCII
    assert ids("no such words") == []
    assert len(ids("")) == len(ids("  ")) == 5  # an empty search is no filter


def test_first_user_message_titles_the_conversation(store: Conversations) -> None:
    c = store.create("m")
    store.add_message(c.id, "system", "you are terse")
    assert store.get(c.id).title is None
    store.add_message(c.id, "user", "\n  Summarise   this article\nIt is long.")
    assert store.get(c.id).title == "Summarise this article"
    store.add_message(c.id, "user", "another question")
    assert store.get(c.id).title == "Summarise this article"

    long = store.create("m")
    store.add_message(long.id, "user", "word " * 40)
    title = store.get(long.id).title
    assert len(title) == 60 and title.endswith("…") and title.startswith("word word")

    named = store.create("m", title="mine")
    store.add_message(named.id, "user", "hello")
    assert store.get(named.id).title == "mine"


def test_update_settings(store: Conversations) -> None:
    c = store.create("a:1", system_prompt="be kind", settings={"engine": {"n_ctx": 2048}})
    c2 = store.update_settings(c.id, settings={"sampling": {"top_p": 0.9}})
    assert c2.settings == {"sampling": {"top_p": 0.9}}  # replaced, not merged
    assert c2.model == "a:1" and c2.system_prompt == "be kind"  # None keeps
    c3 = store.update_settings(c.id, model="b:2", system_prompt="")
    assert c3.model == "b:2" and c3.system_prompt is None
    assert store.get(c.id) == c3
    with pytest.raises(ConversationNotFound):
        store.update_settings(999, model="x")


# -- the message tree ------------------------------------------------------------------------


def test_tree_edit_regenerate_and_navigation(store: Conversations) -> None:
    c = store.create("m")
    u1 = store.add_message(c.id, "user", "hi")
    a1 = store.add_message(c.id, "assistant", "hello")
    assert a1.parent_id == u1.id and store.get(c.id).current_leaf == a1.id

    # regenerate: a second answer to the same question becomes current
    a2 = store.add_message(c.id, "assistant", "hey there", parent_id=u1.id)
    assert [m.id for m in store.siblings(a1.id)] == [a1.id, a2.id]
    assert [m.id for m in store.children(u1.id)] == [a1.id, a2.id]
    assert [m.id for m in store.branch(c.id)] == [u1.id, a2.id]

    # edit the first question: a new root sibling; the old branch is kept
    u1b = store.edit(u1.id, "hi!")
    assert (u1b.parent_id, u1b.role, u1b.content) == (None, "user", "hi!")
    assert store.get_message(u1.id).content == "hi"
    assert [m.id for m in store.siblings(u1.id)] == [u1.id, u1b.id]
    assert [m.id for m in store.branch(c.id)] == [u1b.id]
    a3 = store.add_message(c.id, "assistant", "yo")
    assert [m.id for m in store.branch(c.id)] == [u1b.id, a3.id]

    # going back to the old question leads on to its newest leaf
    assert store.set_current_leaf(c.id, u1.id).id == a2.id
    assert [m.id for m in store.branch(c.id)] == [u1.id, a2.id]

    # continue under the older answer; its subtree now holds the newest leaf
    store.set_current_leaf(c.id, a1.id)
    u2 = store.add_message(c.id, "user", "more")
    a4 = store.add_message(c.id, "assistant", "sure")
    assert [m.id for m in store.branch(c.id)] == [u1.id, a1.id, u2.id, a4.id]
    store.set_current_leaf(c.id, u1b.id)
    assert store.set_current_leaf(c.id, u1.id).id == a4.id
    assert store.set_current_leaf(c.id, a2.id).id == a2.id  # a leaf stays itself
    assert store.children(a4.id) == []

    # editing a middle message branches at its parent
    u2b = store.edit(u2.id, "less")
    assert u2b.parent_id == a1.id
    assert [m.id for m in store.branch(c.id)] == [u1.id, a1.id, u2b.id]


def test_tree_refuses_foreign_and_unknown_ids(store: Conversations) -> None:
    c = store.create("m")
    other = store.create("m")
    foreign = store.add_message(other.id, "user", "elsewhere")
    store.add_message(c.id, "user", "here")
    with pytest.raises(MessageNotFound, match="not in conversation"):
        store.set_current_leaf(c.id, foreign.id)
    with pytest.raises(MessageNotFound, match="not in conversation"):
        store.add_message(c.id, "assistant", "x", parent_id=foreign.id)
    for call in (
        lambda: store.get_message(999),
        lambda: store.update_message(999, content="x"),
        lambda: store.edit(999, "x"),
        lambda: store.siblings(999),
        lambda: store.children(999),
    ):
        with pytest.raises(MessageNotFound, match="no message with id 999"):
            call()
    with pytest.raises(ConversationNotFound):
        store.add_message(999, "user", "x")
    with pytest.raises(ValueError):
        store.add_message(c.id, "robot", "x")
    with pytest.raises(ValueError):
        store.add_message(c.id, "user", "x", status="done")
    assert len(store.branch(c.id)) == 1  # nothing was added by the refusals


def test_update_message_while_streaming(store: Conversations, clock: None) -> None:
    c = store.create("m")
    store.add_message(c.id, "user", "count")
    a = store.add_message(c.id, "assistant", "", status="streaming", meta={"model": "m"})
    before = store.get(c.id).updated
    store.update_message(a.id, content="one two")
    m = store.update_message(a.id, status="complete", meta={"finish_reason": "stop"})
    assert (m.content, m.status) == ("one two", "complete")
    assert m.meta == {"model": "m", "finish_reason": "stop"}  # merged
    assert store.get(c.id).updated > before
    with pytest.raises(ValueError):
        store.update_message(a.id, status="finished")


def test_export_markdown(store: Conversations) -> None:
    c = store.create("smollm2:latest", system_prompt="Be brief.")
    u = store.add_message(c.id, "user", "What is 2+2?")
    store.add_message(c.id, "assistant", "5")
    store.add_message(c.id, "assistant", "4", parent_id=u.id)  # regenerated: only this is shown
    store.add_message(c.id, "user", "And 3+3?")
    store.add_message(c.id, "assistant", "It is", status="partial")
    assert store.export_markdown(c.id) == textwrap.dedent(
        """\
        # What is 2+2?

        Model: smollm2:latest

        **System**

        Be brief.

        **User**

        What is 2+2?

        **Assistant**

        4

        **User**

        And 3+3?

        **Assistant**

        It is

        _(interrupted)_
        """
    )
    empty = store.create("m")
    assert store.export_markdown(empty.id) == "# Untitled conversation\n\nModel: m\n"


# -- faults ----------------------------------------------------------------------------------

STREAMER = textwrap.dedent(
    """
    import sys, time
    from localllm.conversations import Conversations

    store = Conversations(sys.argv[1])
    c = store.create("tiny")
    store.add_message(c.id, "user", "count for me")
    a = store.add_message(c.id, "assistant", "", status="streaming")
    text = ""
    for i in range(100_000):
        text += f"tok{i} "
        store.update_message(a.id, content=text, status="streaming")
        if i == 4:
            print(a.id, flush=True)
        time.sleep(0.01)
    """
)


def test_kill_mid_stream_keeps_the_partial_answer(tmp_path: Path) -> None:
    db = tmp_path / "conversations.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", STREAMER, str(db)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the streamer died before writing: {line!r}"
        threading.Event().wait(0.2)  # let it write some more
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL  # killed mid-stream, not finished
    assert Path(f"{db}-wal").exists()  # the answer lives in the WAL that was never checkpointed
    msg_id = int(line)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT status FROM messages WHERE id = ?", (msg_id,)).fetchone() == (
        "streaming",
    )
    conn.close()

    with Conversations(db) as store:
        m = store.get_message(msg_id)
        n = m.content.count("tok")
        assert n >= 5 and m.content == "".join(f"tok{i} " for i in range(n))
        assert m.status == "partial" and m.interrupted
        branch = store.branch(m.conversation_id)
        assert [x.role for x in branch] == ["user", "assistant"] and branch[-1].id == msg_id
        assert store.export_markdown(m.conversation_id).endswith("_(interrupted)_\n")
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()


def test_threads_share_one_store(tmp_path: Path) -> None:
    """Two workers write while a third reads, as Textual workers would. Everything runs in daemon
    threads so that a deadlock (what unguarded sharing of one connection can do) fails the test
    instead of hanging it."""
    store = Conversations(tmp_path / "c.db")
    convs = [store.create("m"), store.create("m")]
    errors: list[BaseException] = []
    writing = threading.Event()

    def write(conv_id: int) -> None:
        try:
            for i in range(150):
                m = store.add_message(conv_id, "assistant", "", status="streaming")
                store.update_message(m.id, content=f"answer {i}", status="complete")
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    def read() -> None:
        try:
            while writing.is_set():
                store.list()
                store.list(search="answer 1")
                for c in convs:
                    store.branch(c.id)
        except BaseException as e:
            errors.append(e)

    writing.set()
    writers = [threading.Thread(target=write, args=(c.id,), daemon=True) for c in convs]
    reader = threading.Thread(target=read, daemon=True)
    for t in [*writers, reader]:
        t.start()
    for t in writers:
        t.join(timeout=60)
    writing.clear()
    reader.join(timeout=10)
    assert not any(t.is_alive() for t in [*writers, reader]), "the threads deadlocked"
    assert errors == []
    for c in convs:
        branch = store.branch(c.id)
        assert len(branch) == 150 and all(m.status == "complete" for m in branch)
    store.close()


def test_disk_full_changes_nothing(store: Conversations) -> None:
    c = store.create("m")
    u = store.add_message(c.id, "user", "hi")
    before = (store.get(c.id), store.branch(c.id))
    # SQLite reports a database that may not grow exactly as it reports a full disk
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")
    big = "x" * 200_000
    for call in (
        lambda: store.add_message(c.id, "assistant", big),
        lambda: store.update_message(u.id, content=big),
        lambda: store.edit(u.id, big),
    ):
        with pytest.raises(ConversationStoreError, match="disk full") as e:
            call()
        assert_one_line(e, store.path)
        assert (store.get(c.id), store.branch(c.id)) == before


def test_a_write_failing_halfway_leaves_nothing(store: Conversations) -> None:
    c = store.create("m")
    u = store.add_message(c.id, "user", "hi")
    before = (store.get(c.id), store.branch(c.id))
    # Each of these writes a message first and then its conversation; make the second step fail.
    store._conn.execute(
        "CREATE TEMP TRIGGER fail AFTER UPDATE ON conversations"
        " BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
    )
    for call in (
        lambda: store.add_message(c.id, "assistant", "hello"),
        lambda: store.update_message(u.id, content="changed"),
        lambda: store.edit(u.id, "changed"),
    ):
        with pytest.raises(ConversationStoreError, match="injected failure") as e:
            call()
        assert_one_line(e, store.path)
        assert (store.get(c.id), store.branch(c.id)) == before
    assert raw_count(store.path, "SELECT count(*) FROM messages") == 1


def write_some(path: Path) -> None:
    with Conversations(path) as s:
        for i in range(20):
            c = s.create("m", title=f"chat {i}")
            s.add_message(c.id, "user", "question " * 200)
            s.add_message(c.id, "assistant", "answer " * 300)


def test_random_bytes_are_refused(tmp_path: Path) -> None:
    db = tmp_path / "conversations.db"
    db.write_bytes(os.urandom(8192))
    with pytest.raises(ConversationStoreError, match="not a readable") as e:
        Conversations(db)
    assert_one_line(e, db)


@pytest.mark.parametrize("keep", [20, 60, 100, 4096, 0.5, -4096])
def test_truncated_database_is_refused(tmp_path: Path, keep: float) -> None:
    db = tmp_path / "conversations.db"
    write_some(db)
    assert not Path(f"{db}-wal").exists()  # closed cleanly: everything is in the main file
    data = db.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    db.write_bytes(data[:cut])
    with pytest.raises(ConversationStoreError, match="not a readable") as e:
        Conversations(db)
    assert_one_line(e, db)


def test_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    db = tmp_path / "conversations.db"
    write_some(db)
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {conv_mod.SCHEMA_VERSION + 1}")
    conn.close()
    data = db.read_bytes()
    with pytest.raises(ConversationStoreError, match="newer localllm") as e:
        Conversations(db)
    assert_one_line(e, db)
    assert db.read_bytes() == data


def test_closed_store_says_so(tmp_path: Path) -> None:
    s = Conversations(tmp_path / "c.db")
    c = s.create("m")
    s.close()
    with pytest.raises(ConversationStoreError, match="closed"):
        s.get(c.id)


def test_rows_are_read_by_column_name(tmp_path: Path) -> None:
    """A column added to either table (by a later schema, or by hand) does not shift the reading."""
    db = tmp_path / "conversations.db"
    with Conversations(db) as s:
        c = s.create("m", title="kept", settings={"sampling": {"temperature": 0.5}})
        m = s.add_message(c.id, "user", "hello", meta={"k": 1})
    conn = sqlite3.connect(db)
    conn.execute("ALTER TABLE conversations ADD COLUMN pinned INTEGER DEFAULT 1")
    conn.execute("ALTER TABLE messages ADD COLUMN tokens INTEGER DEFAULT 7")
    conn.commit()
    conn.close()
    with Conversations(db) as s:
        conv = s.get(c.id)
        assert (conv.title, conv.model, conv.current_leaf) == ("kept", "m", m.id)
        assert conv.settings == {"sampling": {"temperature": 0.5}}
        assert [x.id for x in s.list()] == [c.id]
        (msg,) = s.branch(c.id)
        assert (msg.role, msg.content, msg.status, msg.meta) == ("user", "hello", "complete", {"k": 1})
        assert s.siblings(m.id) == [msg] and s.children(m.id) == []
        s.add_message(c.id, "assistant", "hi")  # and writes still work
        assert [x.content for x in s.branch(c.id)] == ["hello", "hi"]


# -- settings: sampling and load options -----------------------------------------------------


def test_chat_settings_round_trip(store: Conversations) -> None:
    from localllm.conversations import ChatSettings
    from localllm.types import LoadOptions

    cs = ChatSettings({"temperature": 0.0, "max_tokens": 32},
                      LoadOptions(ctx=2048, kv_cache="q8_0", streaming="4:1020"))  # fmt: skip
    saved = cs.to_dict()
    assert saved == {"sampling": {"temperature": 0.0, "max_tokens": 32},
                     "load": {"ctx": 2048, "kv_cache": "q8_0", "streaming": "4:1020"}}  # fmt: skip
    c = store.create("m", settings=saved)
    back = store.get(c.id).chat_settings
    assert back == cs and back.ignored == ()
    assert ChatSettings().to_dict() == {}
    off = ChatSettings(think=False)
    assert off.to_dict() == {"think": False} and ChatSettings.from_dict(off.to_dict()) == off


def test_chat_settings_read_the_flat_form_of_earlier_versions() -> None:
    from localllm.conversations import ChatSettings
    from localllm.types import LoadOptions

    cs = ChatSettings.from_dict({"temperature": 0.2, "ctx": 2048, "kv_cache": "q8_0",
                                 "streaming": "4:2044"})  # fmt: skip
    assert cs.sampling == {"temperature": 0.2}
    assert cs.options == LoadOptions(ctx=2048, kv_cache="q8_0", streaming="4:2044")
    assert cs.ignored == ()


def test_unknown_or_bad_saved_options_are_dropped_and_listed() -> None:
    from localllm.conversations import ChatSettings
    from localllm.types import LoadOptions

    cs = ChatSettings.from_dict({
        "sampling": {"temperature": 0.3, "top_p": 7, "mirostat": 2},
        "load": {"ctx": 1024, "kv_cache": "q9_9", "mlx_layers": 3, "backend": "vllm"},
        "theme": "dark",
        "think": "very",
    })  # fmt: skip
    assert cs.sampling == {"temperature": 0.3}
    assert cs.options == LoadOptions(ctx=1024) and cs.think is None
    assert sorted(cs.ignored) == ["load.backend", "load.kv_cache", "load.mlx_layers",
                                  "sampling.mirostat", "sampling.top_p", "theme", "think"]  # fmt: skip
