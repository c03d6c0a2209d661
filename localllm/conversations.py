"""The app's saved conversations: one SQLite database in the store folder.

    $LOCALLLM_HOME/conversations.db      (plus -wal and -shm beside it while open)
      conversations  id, title, model, system_prompt, settings_json, current_leaf, created, updated
      messages       id, conversation_id, parent_id, role, content, status, meta_json, created

Messages form a tree: editing a past message or regenerating an answer adds a sibling instead of
overwriting, so every earlier branch stays. A conversation's current branch is the path from its
root to `current_leaf`.

Atomicity comes from SQLite rather than from a temporary file and a rename (ARCHITECTURE.md): every
change is one transaction in WAL mode, so a kill at any moment leaves the last committed state. A
streaming answer is saved as it grows with status 'streaming'; if the process dies before it is
marked finished, the next open turns it into 'partial' — the text so far is kept and marked.

One connection is shared by the app's threads (Textual workers are threads) behind one lock, and
every failure a user can meet — a file that is not SQLite or is damaged, a database from a newer
localllm, a full disk — is one `ConversationStoreError` line naming the file.

A conversation's `settings` are JSON with two parts that front doors read through
`ChatSettings.from_dict`: `sampling` (SamplingParams keywords) and `load` (`LoadOptions.to_dict()`:
what fixes the loaded engine). Keys this localllm does not know, or values it cannot use, are
dropped and listed in `ignored`, so a conversation saved by another version still opens.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from localllm.errors import LocalLLMError
from localllm.models_registry.store import default_home
from localllm.types import LoadOptions, SamplingParams

ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "streaming", "partial", "error", "cancelled")
TITLE_MAX = 60

# How export_markdown marks an answer that did not finish normally.
_MARKS = {
    "partial": "_(interrupted)_",
    "cancelled": "_(stopped)_",
    "error": "_(error)_",
    "streaming": "_(still generating)_",
}


class ConversationStoreError(LocalLLMError):
    """The conversations database cannot be read or written: names the file and the reason."""


class _NotFound(ConversationStoreError, KeyError):
    # A KeyError for callers that catch lookups, but printed as the plain line (KeyError quotes it).
    __str__ = BaseException.__str__


class ConversationNotFound(_NotFound):
    """No conversation with that id."""


class MessageNotFound(_NotFound):
    """No message with that id (or not in the conversation named)."""


def default_db_path() -> Path:
    """`conversations.db` in the store folder (which honours `$LOCALLLM_HOME`)."""
    return default_home() / "conversations.db"


@dataclass(frozen=True)
class ChatSettings:
    """A conversation's sampling and engine options, as saved in its `settings`.

    Stored as `{"sampling": {...}, "load": LoadOptions.to_dict(), "think": bool}`; the flat dicts
    of earlier versions (`{"temperature": 0.2, "ctx": 2048, "kv_cache": "q8_0"}`) read the same way.
    """

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords
    options: LoadOptions = field(default_factory=LoadOptions)
    ignored: tuple[str, ...] = ()  # saved keys dropped on reading: unknown here, or bad values
    think: bool | None = None  # a thinking model thinks, or not; None: the model's own default

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sampling:
            out["sampling"] = dict(self.sampling)
        if load := self.options.to_dict():
            out["load"] = load
        if self.think is not None:
            out["think"] = self.think
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ChatSettings:
        d = dict(d or {})
        ignored: list[str] = []
        think = d.pop("think", None)
        if not isinstance(think, bool | None):
            ignored.append("think")
            think = None
        if "sampling" in d or "load" in d:
            sampling = d.pop("sampling", None)
            load = d.pop("load", None)
            sampling = sampling if isinstance(sampling, dict) else {}
            load = load if isinstance(load, dict) else {}
            ignored += list(d)
            prefix = ("sampling.", "load.")
        else:  # the flat form of earlier versions
            known_load = set(LoadOptions.__dataclass_fields__)
            load = {k: v for k, v in d.items() if k in known_load}
            sampling = {k: v for k, v in d.items() if k not in known_load}
            prefix = ("", "")
        kept: dict[str, Any] = {}
        for k, v in sampling.items():
            try:  # one key at a time, so one bad value costs only itself
                SamplingParams.from_kwargs(**{k: v})
            except (LocalLLMError, TypeError, ValueError, AttributeError):
                ignored.append(prefix[0] + k)
                continue
            if v is not None:
                kept[k] = v
        ignored += [prefix[1] + k for k in LoadOptions.unknown(load)]
        options = LoadOptions()
        for k, v in load.items():
            if k in LoadOptions.__dataclass_fields__ and v is not None:
                try:
                    options = options.replace(**{k: v})
                except (LocalLLMError, TypeError, ValueError, AttributeError):
                    ignored.append(prefix[1] + k)
        return cls(kept, options, tuple(ignored), think)


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str | None  # None until the first user message or a rename gives one
    model: str
    system_prompt: str | None
    settings: dict[str, Any] = field(hash=False)  # as saved; read it with `chat_settings`
    current_leaf: int | None  # last message of the current branch; None while empty
    created: float
    updated: float  # last message written; the list is ordered by it

    @property
    def chat_settings(self) -> ChatSettings:
        return ChatSettings.from_dict(self.settings)


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    parent_id: int | None  # None: a root (the first message, or an edit of it)
    role: str  # one of ROLES
    content: str
    status: str  # one of STATUSES
    meta: dict[str, Any] = field(hash=False)  # usage, timings, finish reason, error text …
    created: float

    @property
    def interrupted(self) -> bool:
        """The process died while this answer streamed; `content` is what was saved by then."""
        return self.status == "partial"

    @property
    def images(self) -> list[bytes]:
        """The images attached to this message (none where a hand-edited meta cannot be read:
        the text still goes)."""
        import base64
        import binascii

        try:
            return [base64.b64decode(x) for x in self.meta.get("images") or ()]
        except (binascii.Error, TypeError, ValueError):
            return []

    def chat(self) -> dict[str, Any]:
        """The message as the engine takes it: its role, its text and its images."""
        images = self.images
        return {"role": self.role, "content": self.content} | ({"images": images} if images else {})


def image_meta(images: Sequence[bytes], names: Sequence[str] = ()) -> dict[str, Any]:
    """What a message's meta keeps of its attached images ({} when none): base64, and their
    names where known."""
    import base64

    if not images:
        return {}
    return {"images": [base64.b64encode(x).decode() for x in images]} | ({"image_names": list(names)} if names else {})


class _Parent(enum.Enum):
    LEAF = "the conversation's current leaf"


# -- schema ------------------------------------------------------------------------------------


def _create_v1(conn: sqlite3.Connection) -> None:
    # current_leaf has no foreign key: it would make the two tables refer to each other, and
    # messages are only ever deleted together with their conversation. The code checks it instead.
    conn.execute(
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT,
            model TEXT NOT NULL,
            system_prompt TEXT,
            settings_json TEXT NOT NULL DEFAULT '{}',
            current_leaf INTEGER,
            created REAL NOT NULL,
            updated REAL NOT NULL)"""
    )
    conn.execute(
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
            content TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('complete', 'streaming', 'partial', 'error', 'cancelled')),
            meta_json TEXT NOT NULL DEFAULT '{}',
            created REAL NOT NULL)"""
    )
    conn.execute("CREATE INDEX messages_conversation ON messages(conversation_id)")
    conn.execute("CREATE INDEX messages_parent ON messages(parent_id)")
    conn.execute("CREATE INDEX conversations_updated ON conversations(updated)")


# _MIGRATIONS[n] brings a database at schema version n to n + 1 (version 0: an empty file).
# To change the schema, append a function; never edit one that has shipped.
_MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_create_v1]
SCHEMA_VERSION = len(_MIGRATIONS)


# -- the store ---------------------------------------------------------------------------------


class Conversations:
    """Saved conversations in one SQLite file; safe to share between threads.

    Opening creates the file (and its folders), checks that it is a database this version can
    read, brings an older schema up to date, and marks answers left 'streaming' by a process that
    died as 'partial'.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self._lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConversationStoreError(
                f"cannot create {self.path.parent}: {e.strerror or e}"
            ) from None
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, because the sqlite3 module's
            # implicit transactions do not cover DDL or PRAGMA user_version (see _write).
            self._conn = sqlite3.connect(
                self.path, timeout=5.0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as e:
            raise ConversationStoreError(f"cannot open {self.path}: {e}") from None
        self._conn.create_function("_casefold", 1, _casefold, deterministic=True)
        try:
            self._open()
        except BaseException:
            self._conn.close()
            raise

    def _open(self) -> None:
        with self._read():
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            # Reading the schema is what notices a damaged or truncated file.
            self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            self._check_version(version)
            self._conn.execute("PRAGMA journal_mode=WAL")
            # In WAL mode, synchronous=NORMAL fsyncs only at checkpoints, not at every commit. A
            # commit still writes the WAL before it returns, so a killed process loses nothing
            # committed; only an OS crash or power cut can drop the last few commits, and even
            # then the file stays consistent. That is the right trade for a save every ~0.5 s.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
        while version < SCHEMA_VERSION:
            with self._write():
                # Re-read inside the write transaction: another process may have migrated.
                version = self._conn.execute("PRAGMA user_version").fetchone()[0]
                self._check_version(version)
                if version < SCHEMA_VERSION:
                    _MIGRATIONS[version](self._conn)
                    version += 1
                    self._conn.execute(f"PRAGMA user_version = {version:d}")
        with self._write():
            self._conn.execute("UPDATE messages SET status = 'partial' WHERE status = 'streaming'")

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise ConversationStoreError(
                f"{self.path} was written by a newer localllm (schema {version}, this one reads "
                f"up to {SCHEMA_VERSION}); upgrade localllm or move the file aside"
            )

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Conversations:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions and errors ---------------------------------------------------------------

    @contextlib.contextmanager
    def _read(self) -> Iterator[None]:
        with self._lock, self._errors():
            yield

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """One transaction: all of the block or none of it, whatever is raised inside."""
        with self._lock, self._errors():
            if self._conn.in_transaction:  # nested (edit → add_message): part of the outer one
                yield
                return
            # IMMEDIATE takes the write lock up front, so two processes cannot deadlock upgrading.
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._conn.execute("COMMIT")
            except BaseException:
                # After some errors (a full disk) SQLite has already rolled back by itself.
                if self._conn.in_transaction:
                    self._conn.rollback()
                raise

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.ProgrammingError as e:
            if "closed" in str(e):
                raise ConversationStoreError(f"{self.path} is closed") from None
            raise
        except sqlite3.Error as e:
            name = getattr(e, "sqlite_errorname", "")
            if name == "SQLITE_FULL" or "disk is full" in str(e):
                msg = f"disk full while saving to {self.path}; nothing was changed"
            elif name.startswith("SQLITE_BUSY") or "locked" in str(e):
                msg = f"{self.path} is busy (another localllm is writing); try again"
            elif name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
                msg = f"{self.path} is not a readable conversations database ({e})"
            else:
                msg = f"{self.path}: {e}"
            raise ConversationStoreError(msg) from None

    # -- conversations -------------------------------------------------------------------------

    def create(
        self,
        model: str,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Conversation:
        """A new, empty conversation."""
        now = time.time()
        with self._write():
            cur = self._conn.execute(
                "INSERT INTO conversations (title, model, system_prompt, settings_json, created,"
                " updated) VALUES (?, ?, ?, ?, ?, ?)",
                (_title(title), model, system_prompt or None, _dumps(settings), now, now),
            )
            return self._conversation(cur.lastrowid)

    def get(self, conv_id: int) -> Conversation:
        with self._read():
            return self._conversation(conv_id)

    def list(self, search: str | None = None, limit: int = 200) -> builtins.list[Conversation]:
        """Newest first (by `updated`). `search` matches titles and the text of any message.

        Matching is case-insensitive for all of Unicode (SQLite's LIKE folds only ASCII) and
        literal: `%` and `_` are ordinary characters.
        """
        sql = f"SELECT {_CONV_COLS} FROM conversations"
        args: builtins.list[Any] = []
        if search and search.strip():
            sql += (
                " WHERE instr(_casefold(title), ?) OR EXISTS (SELECT 1 FROM messages"
                " WHERE conversation_id = conversations.id AND instr(_casefold(content), ?))"
            )
            needle = search.strip().casefold()
            args += [needle, needle]
        sql += " ORDER BY updated DESC, id DESC LIMIT ?"
        args.append(limit)
        with self._read():
            return [_to_conversation(r) for r in self._conn.execute(sql, args)]

    def rename(self, conv_id: int, title: str) -> Conversation:
        """Sets the title (whitespace collapsed; empty clears it). Keeps the list order."""
        with self._write():
            self._conversation(conv_id)
            self._conn.execute(
                "UPDATE conversations SET title = ? WHERE id = ?", (_title(title), conv_id)
            )
            return self._conversation(conv_id)

    def delete(self, conv_id: int) -> None:
        """Removes the conversation and all its messages."""
        with self._write():
            cur = self._conn.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
            if cur.rowcount == 0:
                raise ConversationNotFound(f"no conversation with id {conv_id}")

    def update_settings(
        self,
        conv_id: int,
        *,
        model: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Conversation:
        """Changes what is given; None keeps a value. `system_prompt=""` removes the prompt;
        `settings` replaces the whole dict."""
        with self._write():
            self._conversation(conv_id)
            if model is not None:
                self._conn.execute(
                    "UPDATE conversations SET model = ? WHERE id = ?", (model, conv_id)
                )
            if system_prompt is not None:
                self._conn.execute(
                    "UPDATE conversations SET system_prompt = ? WHERE id = ?",
                    (system_prompt or None, conv_id),
                )
            if settings is not None:
                self._conn.execute(
                    "UPDATE conversations SET settings_json = ? WHERE id = ?",
                    (_dumps(settings), conv_id),
                )
            return self._conversation(conv_id)

    # -- messages ------------------------------------------------------------------------------

    def add_message(
        self,
        conv_id: int,
        role: str,
        content: str,
        *,
        parent_id: int | None | Literal[_Parent.LEAF] = _Parent.LEAF,
        status: str = "complete",
        meta: dict[str, Any] | None = None,
    ) -> Message:
        """Appends a message under `parent_id` (default: the current leaf; None: a new root) and
        makes it the current leaf. The first user message titles an untitled conversation."""
        _check(role=role, status=status)
        now = time.time()
        with self._write():
            conv = self._conversation(conv_id)
            if parent_id is _Parent.LEAF:
                parent_id = conv.current_leaf
            if parent_id is not None:
                self._message(parent_id, conv_id)
            cur = self._conn.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, status,"
                " meta_json, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conv_id, parent_id, role, content, status, _dumps(meta), now),
            )
            msg_id = cur.lastrowid
            title = conv.title
            if title is None and role == "user":
                title = _title_from(content)
            self._conn.execute(
                "UPDATE conversations SET current_leaf = ?, updated = ?, title = ? WHERE id = ?",
                (msg_id, now, title, conv_id),
            )
            return self._message(msg_id)

    def update_message(
        self,
        msg_id: int,
        *,
        content: str | None = None,
        status: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Message:
        """Saves a streaming answer as it grows, then its final status. None keeps a value;
        `meta` is merged into the message's meta (one level deep)."""
        if status is not None:
            _check(status=status)
        with self._write():
            old = self._message(msg_id)
            merged = {**old.meta, **meta} if meta else old.meta
            self._conn.execute(
                "UPDATE messages SET content = ?, status = ?, meta_json = ? WHERE id = ?",
                (
                    old.content if content is None else content,
                    status or old.status,
                    _dumps(merged),
                    msg_id,
                ),
            )
            self._conn.execute(
                "UPDATE conversations SET updated = ? WHERE id = ?",
                (time.time(), old.conversation_id),
            )
            return self._message(msg_id)

    def get_message(self, msg_id: int) -> Message:
        with self._read():
            return self._message(msg_id)

    def branch(self, conv_id: int) -> builtins.list[Message]:
        """The current branch, root first: what the model sees and the chat screen shows."""
        with self._read():
            leaf = self._conversation(conv_id).current_leaf
            if leaf is None:
                return []
            rows = self._conn.execute(
                f"""WITH RECURSIVE path(id, depth) AS (
                       SELECT ?, 0
                       UNION ALL
                       SELECT m.parent_id, path.depth + 1 FROM messages m JOIN path ON m.id = path.id
                       WHERE m.parent_id IS NOT NULL)
                   SELECT {_MSG_COLS_Q} FROM path JOIN messages USING (id)
                   ORDER BY depth DESC""",
                (leaf,),
            )
            return [_to_message(r) for r in rows]

    def children(self, msg_id: int) -> builtins.list[Message]:
        """Direct replies to a message, oldest first."""
        with self._read():
            self._message(msg_id)
            rows = self._conn.execute(
                f"SELECT {_MSG_COLS} FROM messages WHERE parent_id = ? ORDER BY id", (msg_id,)
            )
            return [_to_message(r) for r in rows]

    def siblings(self, msg_id: int) -> builtins.list[Message]:
        """The message and its alternatives (same parent), oldest first: "branch 2/3" is
        `index + 1` of `len`."""
        with self._read():
            m = self._message(msg_id)
            rows = self._conn.execute(
                f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? AND parent_id IS ?"
                " ORDER BY id",
                (m.conversation_id, m.parent_id),
            )
            return [_to_message(r) for r in rows]

    def set_current_leaf(self, conv_id: int, msg_id: int) -> Message:
        """Switches branch. A message with replies leads on to its most recent descendant leaf
        (the last place the user was in that subtree); returns the new leaf."""
        with self._write():
            self._conversation(conv_id)
            self._message(msg_id, conv_id)
            leaf = self._conn.execute(
                """WITH RECURSIVE sub(id) AS (
                       SELECT ?
                       UNION ALL
                       SELECT m.id FROM messages m JOIN sub ON m.parent_id = sub.id)
                   SELECT id FROM sub
                   WHERE NOT EXISTS (SELECT 1 FROM messages c WHERE c.parent_id = sub.id)
                   ORDER BY id DESC LIMIT 1""",
                (msg_id,),
            ).fetchone()[0]
            self._conn.execute(
                "UPDATE conversations SET current_leaf = ? WHERE id = ?", (leaf, conv_id)
            )
            return self._message(leaf)

    def edit(self, msg_id: int, new_content: str) -> Message:
        """Edits a past message by adding a sibling with the new text (same parent and role) and
        making it current; the old branch stays reachable through `siblings`."""
        with self._write():
            old = self._message(msg_id)
            return self.add_message(
                old.conversation_id, old.role, new_content, parent_id=old.parent_id
            )

    # -- export --------------------------------------------------------------------------------

    def export_markdown(self, conv_id: int) -> str:
        """The current branch as Markdown: title, model, system prompt, then one section per
        message; answers that did not finish are marked."""
        with self._read():
            conv = self._conversation(conv_id)
            messages = self.branch(conv_id)
        parts = [f"# {conv.title or 'Untitled conversation'}", f"Model: {conv.model}"]
        if conv.system_prompt:
            parts += ["**System**", conv.system_prompt.strip()]
        for m in messages:
            parts.append(f"**{m.role.capitalize()}**")
            if m.content.strip():
                parts.append(m.content.strip())
            if m.status in _MARKS:
                parts.append(_MARKS[m.status])
        return "\n\n".join(parts) + "\n"

    # -- rows ----------------------------------------------------------------------------------

    def _conversation(self, conv_id: int) -> Conversation:
        row = self._conn.execute(
            f"SELECT {_CONV_COLS} FROM conversations WHERE id = ?", (conv_id,)
        ).fetchone()
        if row is None:
            raise ConversationNotFound(f"no conversation with id {conv_id}")
        return _to_conversation(row)

    def _message(self, msg_id: int, conv_id: int | None = None) -> Message:
        row = self._conn.execute(
            f"SELECT {_MSG_COLS} FROM messages WHERE id = ?", (msg_id,)
        ).fetchone()
        if row is None:
            raise MessageNotFound(f"no message with id {msg_id}")
        m = _to_message(row)
        if conv_id is not None and m.conversation_id != conv_id:
            raise MessageNotFound(f"message {msg_id} is not in conversation {conv_id}")
        return m


# Rows are read by naming their columns, never with `SELECT *` by position: a column added by a
# later schema (or by hand) must not shift what the reader takes for the settings or the leaf.
_CONV_COLUMNS = ("id", "title", "model", "system_prompt", "settings_json", "current_leaf",
                 "created", "updated")  # fmt: skip
_MSG_COLUMNS = ("id", "conversation_id", "parent_id", "role", "content", "status", "meta_json",
                "created")  # fmt: skip
_CONV_COLS = ", ".join(_CONV_COLUMNS)
_MSG_COLS = ", ".join(_MSG_COLUMNS)
_MSG_COLS_Q = ", ".join(f"messages.{c}" for c in _MSG_COLUMNS)


def _to_conversation(row: tuple[Any, ...]) -> Conversation:
    id_, title, model, system_prompt, settings_json, current_leaf, created, updated = row
    return Conversation(
        id=id_,
        title=title,
        model=model,
        system_prompt=system_prompt,
        settings=_loads(settings_json),
        current_leaf=current_leaf,
        created=created,
        updated=updated,
    )


def _to_message(row: tuple[Any, ...]) -> Message:
    id_, conversation_id, parent_id, role, content, status, meta_json, created = row
    return Message(
        id=id_,
        conversation_id=conversation_id,
        parent_id=parent_id,
        role=role,
        content=content,
        status=status,
        meta=_loads(meta_json),
        created=created,
    )


def _check(*, role: str | None = None, status: str | None = None) -> None:
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")


def _title(text: str | None) -> str | None:
    """Whitespace collapsed to single spaces (a title is one line); empty means none."""
    if text is None:
        return None
    return " ".join(text.split()) or None


def _title_from(content: str) -> str | None:
    """The first non-blank line of a message, cut to TITLE_MAX characters."""
    line = next((ln for ln in content.splitlines() if ln.strip()), "")
    title = _title(line)
    if title and len(title) > TITLE_MAX:
        title = title[: TITLE_MAX - 1].rstrip() + "…"
    return title


def _casefold(text: str | None) -> str | None:
    return text.casefold() if text is not None else None


def _dumps(d: dict[str, Any] | None) -> str:
    return json.dumps(d or {}, sort_keys=True)


def _loads(text: str | None) -> dict[str, Any]:
    """A dict from stored JSON; anything else (hand-edited, damaged) reads as empty."""
    try:
        d = json.loads(text or "{}")
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}
