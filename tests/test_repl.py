"""`localllm run`'s REPL (issue 34): whole multi-line messages and Ollama's slash commands.

The terminal tests run the REPL on a pty with the real readline, as a person's terminal drives it
(bracketed paste markers, `\"\"\"` blocks, Ctrl-C); a recording model stands in for the engine so
each test can say exactly which requests were sent."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from localllm.errors import LocalLLMError
from localllm.repl import Chat, Lines
from localllm.types import LoadOptions, SamplingParams

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))  # bytes the REPL keeps and saves as they are


class Recorder:
    """A model that records each request it is asked and answers `ok`."""

    def __init__(self, name: str = "m", path: Path | None = None) -> None:
        self.name, self.n_ctx, self.closed = name, 64, False
        self.sampling_defaults = {"temperature": 0.6}
        self.runner = SimpleNamespace(name="fake", model_path=path,
                                      chat_template=SimpleNamespace(source="{{ messages }}"))  # fmt: skip
        self.requests: list[Any] = []

    def sampling(self, **kw: Any) -> SamplingParams:
        return SamplingParams.from_kwargs(**(self.sampling_defaults | kw))

    def close(self) -> None:
        self.closed = True


def chat_with(llm: Recorder, out: list[str], **kw: Any) -> Chat:
    loads: list[tuple[str, LoadOptions]] = []

    def load(name: str, options: LoadOptions) -> Recorder:
        if name == "missing":
            raise LocalLLMError("model 'missing' not found")
        loads.append((name, options))
        return Recorder(name)

    def generate(model: Recorder, request: Any) -> Any:
        model.requests.append(request)
        said = request.messages[-1]["content"] if request.messages else ""
        thought = "hm" if said.startswith("think") else None  # a thinking model's reasoning
        return SimpleNamespace(text=f"ok{len(model.requests)}", reasoning=thought,
                               usage=SimpleNamespace(reasoning_tokens=4 if thought else 0))  # fmt: skip

    chat = Chat(llm, LoadOptions(), load, generate, **kw)
    chat.say = out.append  # type: ignore[method-assign]
    chat.loads = loads  # type: ignore[attr-defined]
    return chat


def lines_of(*typed: str, path: Path | None = None, readline: Any = None) -> Lines:
    it = iter(typed)
    seen: list[str] = []

    def read(prompt: str) -> str:
        seen.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    lines = Lines(read, path, readline)
    lines.prompts = seen  # type: ignore[attr-defined]
    return lines


# -- multi-line messages -----------------------------------------------------------------------


def test_a_triple_quote_block_is_one_message() -> None:
    lines = lines_of('"""Here is code:', "def f():", "    return 1", '"""', "next")
    assert lines.message() == "Here is code:\ndef f():\n    return 1"
    assert lines.prompts == [">>> ", "... ", "... ", "... "]  # type: ignore[attr-defined]
    assert lines.message() == "next"
    assert lines_of('"""one line"""').message() == "one line"
    assert lines_of('"""', "a", 'b"""').message() == "a\nb"


def test_a_paste_whose_markers_arrive_is_joined_whole() -> None:
    """Without GNU readline (libedit, TERM=dumb) the terminal's paste markers reach the lines."""
    lines = lines_of("\x1b[200~first", "second", "", "fourth\x1b[201~", "after")
    assert lines.message() == "first\nsecond\n\nfourth"
    assert lines.message() == "after"
    # a paste that begins with \"\"\" is pasted text, not the start of a block
    assert lines_of('\x1b[200~"""doc\nmore\x1b[201~').message() == '"""doc\nmore'


def test_history_keeps_multi_line_messages_whole(tmp_path: Path) -> None:
    readline = pytest.importorskip("readline", reason="Python without readline")
    path = tmp_path / "history.jsonl"
    readline.clear_history()
    lines = lines_of('"""', "a", "b", '"""', "plain", "", path=path, readline=readline)
    assert lines.message() == "a\nb" and lines.message() == "plain"
    assert lines.message() == ""
    n = readline.get_current_history_length()
    assert [readline.get_history_item(i) for i in range(1, n + 1)] == ["a\nb", "plain"]
    readline.clear_history()  # a new session reads them back, still whole
    lines_of(path=path, readline=readline)
    n = readline.get_current_history_length()
    assert [readline.get_history_item(i) for i in range(1, n + 1)] == ["a\nb", "plain"]
    path.write_text(path.read_text() + "not json\n")  # a damaged line costs only itself
    readline.clear_history()
    lines_of(path=path, readline=readline)
    assert readline.get_current_history_length() == 2
    readline.clear_history()


# -- commands ----------------------------------------------------------------------------------


def test_commands_are_never_sent_to_the_model(tmp_path: Path) -> None:
    llm, out = Recorder(), []
    chat = chat_with(llm, out)
    for line in ("/?", "/help", "/frobnicate", "/set", "/set parameter", "/show", "/set bogus 1",
                 "/set parameter warmth 3", "/set parameter top_k many"):  # fmt: skip
        assert chat.handle(line)
    assert llm.requests == []
    assert "/set parameter" in out[0] and out[0] == out[1]
    assert "Unknown command '/frobnicate'" in out[2]
    assert any("Unknown parameter 'warmth'" in o for o in out)
    assert any("top_k takes an integer" in o for o in out)
    assert chat.handle("//etc/hosts is a path")  # a literal slash
    assert llm.requests[0].messages[-1]["content"] == "/etc/hosts is a path"
    assert not chat.handle("/bye")


def test_set_parameters_system_and_format_shape_the_next_requests() -> None:
    llm, out = Recorder(), []
    chat = chat_with(llm, out)
    for line in ("/set parameter temperature 0.2", "/set parameter num_predict 7",
                 "/set parameter seed 42", "/set parameter top_p 0.5", "/set parameter min_p 0.1",
                 "/set parameter top_k 5", "/set parameter repeat_penalty 1.1",
                 '/set parameter stop "<end>"', "/set parameter stop ###",
                 '/set system "You are terse."', "/set format json"):  # fmt: skip
        chat.handle(line)
    chat.handle("hello")
    r = llm.requests[-1]
    s = r.sampling
    assert (s.temperature, s.max_tokens, s.seed, s.top_p, s.min_p, s.top_k, s.repeat_penalty) == (
        0.2, 7, 42, 0.5, 0.1, 5, 1.1)  # fmt: skip
    assert s.stop == ("<end>", "###")
    assert r.messages == ({"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "hello"})  # fmt: skip
    assert r.response_format == {"type": "json_object"}
    chat.handle("/set parameter temperature -1")  # refused in SamplingParams' words; kept 0.2
    assert "temperature must be >= 0" in out[-1]
    chat.handle("/set noformat")
    chat.handle("again")
    r = llm.requests[-1]
    assert r.response_format is None and r.sampling.temperature == 0.2
    assert [m["content"] for m in r.messages] == ["You are terse.", "hello", "ok1", "again"]
    chat.handle("/clear")
    chat.handle("fresh")
    assert [m["content"] for m in llm.requests[-1].messages] == ["You are terse.", "fresh"]
    chat.handle("/show parameters")
    chat.handle("/show system")
    assert "temperature" in out[-2] and "0.2" in out[-2] and out[-1] == "You are terse."


def test_show_reads_the_model_file(default_model_path: Path) -> None:
    llm, out = Recorder(path=default_model_path), []
    chat = chat_with(llm, out)
    chat.handle("/show info")
    assert "llama" in out[-1] and "Q4_1" in out[-1] and "134.5M" in out[-1]
    chat.handle("/show license")
    assert "apache" in out[-1].lower()
    chat.handle("/show template")
    assert out[-1] == "{{ messages }}"


def test_load_and_num_ctx_reload_and_a_failed_load_keeps_a_model() -> None:
    llm, out = Recorder(), []
    chat = chat_with(llm, out)
    chat.handle("hi")
    chat.handle("/load other")
    assert llm.closed and chat.llm.name == "other"
    chat.handle("/set parameter num_ctx 2048")
    assert chat.options.ctx == 2048 and chat.loads[-1] == ("other", chat.options)  # type: ignore[attr-defined]
    chat.handle("/load missing")
    assert "not found" in out[-1] and chat.llm.name == "other" and chat.options.ctx == 2048
    chat.handle("/set parameter num_ctx 0")  # a bad option: nothing is unloaded
    assert "error" in out[-1] and chat.options.ctx == 2048
    chat.handle("again")  # the conversation went on across loads
    assert [m["content"] for m in chat.llm.requests[-1].messages] == ["hi", "ok1", "again"]


def test_save_makes_a_conversation_the_app_opens() -> None:
    from localllm.conversations import Conversations

    llm, out = Recorder(), []
    chat = chat_with(llm, out, system="be brief")
    chat.handle("/set parameter temperature 0.3")
    chat.images = [PNG]  # `run --image`: it goes with the first message
    chat.handle("first")
    chat.handle("think second")
    assert chat.images == [] and llm.requests[0].messages[-1]["images"] == [PNG]
    chat.handle("third")  # the history sent holds the image, and no reasoning
    assert [{k for k in m if k != "content"} for m in llm.requests[-1].messages] == [
        {"role"}, {"role", "images"}, {"role"}, {"role"}, {"role"}, {"role"}]  # fmt: skip
    chat.handle("/save my talk")
    with Conversations() as db:
        (conv,) = [c for c in db.list() if c.title == "my talk"]
        assert conv.model == "m" and conv.system_prompt == "be brief"
        assert conv.chat_settings.sampling == {"temperature": 0.3}
        saved = db.branch(conv.id)
        assert [(m.role, m.content) for m in saved] == [
            ("user", "first"), ("assistant", "ok1"), ("user", "think second"), ("assistant", "ok2"),
            ("user", "third"), ("assistant", "ok3")]  # fmt: skip
        # the app reads the image back, and the reasoning apart from the answer (as it saves its own)
        assert saved[0].chat() == {"role": "user", "content": "first", "images": [PNG]}
        assert saved[3].meta == {"reasoning": "hm", "reasoning_tokens": 4} and saved[1].meta == {}


# -- on a terminal -----------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from localllm.repl import Chat, Lines
    from localllm.types import LoadOptions, SamplingParams
    sent = []
    def generate(llm, request):
        sent.append(request.messages[-1]["content"])
        print(f"answer {len(sent)}", flush=True)
        return SimpleNamespace(text="a", reasoning=None)
    llm = SimpleNamespace(name="m", sampling=lambda **kw: SamplingParams.from_kwargs(**kw))
    Chat(llm, LoadOptions(), None, generate).loop(Lines.terminal(None))
    json.dump(sent, open(sys.argv[1], "w"))
""")


class Terminal:
    """The other end of a pty: what the program wrote, read up to a needle at a time (what came
    after it is kept for the next wait)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def expect(self, needle: bytes, timeout: float = 30) -> bytes:
        end = time.monotonic() + timeout
        while needle not in self.buf:
            left = end - time.monotonic()
            assert left > 0, f"never saw {needle!r}; got {self.buf[-300:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    chunk = b""
                assert chunk, f"the program ended before {needle!r}; got {self.buf[-300:]!r}"
                self.buf += chunk
        seen, _, self.buf = self.buf.partition(needle)
        return seen + needle

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)


def test_on_a_terminal_a_paste_and_a_block_are_one_request_each(tmp_path: Path) -> None:
    sent = tmp_path / "sent.json"
    pid, fd = pty.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ["TERM"] = "xterm-256color"  # a terminal readline takes bracketed pastes from
        os.execv(sys.executable, [sys.executable, "-c", CHILD, str(sent)])
    term = Terminal(fd)
    try:
        term.expect(b">>> ")
        term.type(b"\x1b[200~line 1\nline 2\nline 3\nline 4\nline 5\x1b[201~")
        time.sleep(0.2)  # nothing is sent until Enter
        term.type(b"\r")
        assert b"answer" not in term.expect(b"answer 1")[:-8]
        term.expect(b">>> ")
        term.type(b'"""\r')
        term.expect(b"... ")
        term.type(b'block one\rblock two\r"""\r')
        term.expect(b"answer 2")
        term.expect(b">>> ")
        term.type(b"/nonsense\r")
        term.expect(b"Unknown command")
        term.expect(b">>> ")
        term.type(b"half typed\x03")  # Ctrl-C drops the line, keeps the REPL
        term.expect(b">>> ")
        term.type(b"\x04")  # Ctrl-D leaves
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
    assert json.loads(sent.read_text()) == [
        "line 1\nline 2\nline 3\nline 4\nline 5",
        "block one\nblock two",
    ]
