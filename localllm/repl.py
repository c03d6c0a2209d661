"""`localllm run`'s REPL: whole multi-line messages, history, and Ollama's slash commands.

A message is one line; or a `\"\"\"` block, up to the line that ends with `\"\"\"`; or a paste,
whole, however many lines it has. GNU readline takes a terminal's bracketed paste itself (its
newlines stay in the line); where it does not (libedit, `TERM=dumb`), the paste markers arrive in
the lines read and the lines between them are joined here. History keeps each message whole,
in `repl_history.jsonl` beside the store (readline's own file would split it at newlines).

A line starting with `/` is a command and never reaches the model; `//` sends a literal `/`.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError

PROMPT, MORE = ">>> ", "... "
QUOTES = '"""'
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
HISTORY_KEEP = 1000  # messages kept in the history file

# /set parameter NAME VALUE: Ollama's names (and ours) → SamplingParams keywords and types
PARAMETERS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "seed": ("seed", int),
    "num_predict": ("max_tokens", int),
    "max_tokens": ("max_tokens", int),
    "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "stop": ("stop", str),
    "num_ctx": ("ctx", int),  # a load option: the model reloads with it
}

HELP = """\
Available commands:
  /set parameter NAME VALUE  temperature, top_p, top_k, min_p, seed, num_predict,
                             repeat_penalty, repeat_last_n, stop (one per /set; adds), num_ctx
  /set system TEXT           the system prompt (starts a new conversation)
  /set format json           answer in JSON;  /set noformat  back to text
  /set think | nothink       a thinking model thinks, or answers at once
  /show info|parameters|template|system|license
  /clear                     forget the conversation (the system prompt stays)
  /load MODEL                load another model (the conversation stays)
  /save NAME                 save the conversation for the app (`localllm chat`, Ctrl+L)
  /bye                       leave (also Ctrl-D);  /? or /help  this list
Use \"\"\" to begin and end a multi-line message; a paste is sent whole.
Ctrl-C stops an answer; a line starting with // sends a literal /."""


class Lines:
    """Reads messages with `read` (`input`), keeping each one whole in readline's history and in
    `path` (JSON lines) when given."""

    def __init__(self, read: Callable[[str], str] = input, path: Path | None = None,
                 readline: Any = None) -> None:  # fmt: skip
        self.read, self.path, self.readline = read, path, readline
        if readline is not None:
            readline.set_auto_history(False)  # whole messages are added below, not lines
            for entry in self._saved():
                readline.add_history(entry)

    @classmethod
    def terminal(cls, path: Path | None) -> Lines:
        """`input` with line editing (readline, where Python has it) and the history in `path`."""
        try:
            import readline
        except ImportError:
            readline = None  # type: ignore[assignment]
        return cls(input, path, readline)

    def message(self) -> str:
        """The next message (raw: a command is a message too); EOFError at the end of input."""
        line = self.read(PROMPT)
        if PASTE_START in line:  # the terminal's paste markers reached us: join what they enclose
            while PASTE_END not in line:
                line += "\n" + self.read("")
            before, _, rest = line.partition(PASTE_START)
            pasted, _, after = rest.partition(PASTE_END)
            line = before + pasted + after
        elif "\n" not in line and line.lstrip().startswith(QUOTES):
            body = line.lstrip()[len(QUOTES) :]
            lines = [body]
            while not lines[-1].rstrip().endswith(QUOTES):
                lines.append(self.read(MORE))
            text = "\n".join(lines).rstrip()
            line = text[: -len(QUOTES)].strip("\n")
        self.remember(line)
        return line

    def remember(self, text: str) -> None:
        if not text.strip():
            return
        if self.readline is not None:
            self.readline.add_history(text)
        if self.path is not None:
            with contextlib.suppress(OSError):  # a history that cannot be written is no error
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(text) + "\n")

    def _saved(self) -> list[str]:
        if self.path is None:
            return []
        entries: list[str] = []
        with contextlib.suppress(OSError):
            for row in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(row)
                    if isinstance(entry, str):
                        entries.append(entry)
        if len(entries) > HISTORY_KEEP:  # keep the file from growing without end
            entries = entries[-HISTORY_KEEP:]
            with contextlib.suppress(OSError):
                self.path.write_text(
                    "".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8"
                )
        return entries


@dataclass
class Chat:
    """What a REPL session holds: the model, its conversation and the settings /set changes."""

    llm: Any
    options: Any  # the LoadOptions it was loaded with
    load: Callable[[str, Any], Any]  # (model name, LoadOptions) → a model
    generate: Callable[[Any, Any], Any]  # (model, Request) → Result, streaming it to stdout
    system: str | None = None
    raw: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # over the model's defaults
    response_format: dict[str, Any] | None = None
    think: bool | None = None  # None: the model's own default
    images: list[bytes] = field(default_factory=list)  # `run --image`: for the next message
    # user and assistant turns; an answer's "meta" (its reasoning) is kept for /save, not sent
    history: list[dict[str, Any]] = field(default_factory=list)
    toolbox: Any = None  # mcp_tools.Toolbox: MCP servers' tools, offered to the model
    ask_tool: Callable[[Any], str] = field(default=lambda call: ask_permission(call))
    permissions: Any = None  # mcp_tools.Permissions: the tools allowed always this session

    def say(self, text: str) -> None:
        print(text, flush=True)

    # -- a turn ------------------------------------------------------------------------------

    def handle(self, text: str) -> bool:
        """One message or command; False to leave."""
        if text.startswith("//"):
            text = text[1:]
        elif text.startswith("/"):
            return self.command(text)
        if not text.strip():
            return True
        self.ask(text)
        return True

    def messages(self, text: str) -> tuple[dict[str, Any], ...]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        history = ({k: v for k, v in m.items() if k != "meta"} for m in self.history)
        return (*system, *history, self.user(text))

    def user(self, text: str) -> dict[str, Any]:
        """The user's message; the images given for it go with it (and stay in the history)."""
        return {"role": "user", "content": text} | ({"images": list(self.images)} if self.images else {})

    def request(self, text: str) -> Any:
        """The Request a message makes: the conversation so far and this message, under the
        chat template (or `--raw`: the system prompt and the text as they are)."""
        from localllm.types import Request

        sampling = self.llm.sampling(**self.sampling)
        if self.raw:
            return Request(prompt=(self.system or "") + text, sampling=sampling, images=tuple(self.images),
                           response_format=self.response_format, think=self.think)  # fmt: skip
        tools = tuple(self.toolbox.tools()) if self.toolbox is not None else ()
        return Request(messages=self.messages(text), sampling=sampling, tools=tools,
                       response_format=self.response_format, think=self.think)  # fmt: skip

    def ask(self, text: str) -> Any:
        """Send a message and keep the exchange; an error is one line, Ctrl-C stops the answer.
        With MCP tools, each call the model makes is asked for, run, and its result sent back,
        up to `mcp_tools.MAX_ROUNDS` rounds; the calls and results stay in the conversation."""
        from dataclasses import replace

        from localllm.mcp_tools import MAX_ROUNDS, Permissions, run_round

        turn: list[dict[str, Any]] = []
        try:
            request = self.request(text)
            result = self.generate(self.llm, request)
            rounds = 0
            while self.toolbox is not None and not self.raw and result.tool_calls:
                if rounds == MAX_ROUNDS:
                    self.say(f"(stopped after {MAX_ROUNDS} rounds of tool calls)")
                    break
                rounds += 1
                self.permissions = self.permissions or Permissions()
                sent = run_round(self.toolbox, result, self.ask_tool, self.permissions,
                                 shown=lambda call, out: self.say(f"[{call.name}] {out[:500]}"))  # fmt: skip
                turn += sent
                request = replace(request, messages=(*(request.messages or ()), *sent))
                result = self.generate(self.llm, request)
        except KeyboardInterrupt:
            return None  # the answer was stopped and its line ended
        except LocalLLMError as e:
            print(f"error: {e}", file=sys.stderr)
            return None
        if not self.raw:
            thought = {"meta": {"reasoning": result.reasoning,
                                "reasoning_tokens": result.usage.reasoning_tokens}} if result.reasoning else {}  # fmt: skip
            self.history += [self.user(text), *turn, {"role": "assistant", "content": result.text} | thought]
        self.images = []  # they went with this message
        return result

    # -- commands ----------------------------------------------------------------------------

    def command(self, text: str) -> bool:
        word, _, rest = text.partition(" ")
        rest = rest.strip()
        if word in ("/bye", "/exit", "/quit"):
            return False
        if word in ("/?", "/help"):
            self.say(HELP)
        elif word == "/set":
            self.set(rest)
        elif word == "/show":
            self.show(rest)
        elif word == "/clear":
            self.history.clear()
            self.say("Cleared the conversation.")
        elif word == "/load":
            self.load_model(rest)
        elif word == "/save":
            self.save(rest)
        else:
            self.say(f"Unknown command {word!r}: /? lists the commands (// sends a literal /).")
        return True

    def set(self, rest: str) -> None:
        what, _, value = rest.partition(" ")
        value = value.strip()
        if what == "parameter":
            self.set_parameter(value)
        elif what == "system":
            if not value:
                self.say("Usage: /set system TEXT")
                return
            self.system = _unquote(value)
            self.history.clear()
            self.say("Set system message.")
        elif what == "format" and value == "json":
            self.response_format = {"type": "json_object"}
            self.say("Set format to 'json' mode.")
        elif what in ("think", "nothink"):
            self.think = what == "think"
            self.say(f"Set '{what}' mode.")
        elif what == "noformat":
            self.response_format = None
            self.say("Disabled format.")
        else:
            self.say(f"Unknown /set {what!r}: /? lists what /set takes.")

    def set_parameter(self, spec: str) -> None:
        try:
            name, value = shlex.split(spec)
        except ValueError:
            self.say("Usage: /set parameter NAME VALUE")
            return
        if name not in PARAMETERS:
            self.say(f"Unknown parameter {name!r}; one of: {', '.join(PARAMETERS)}")
            return
        key, kind = PARAMETERS[name]
        try:
            v = kind(value)
        except ValueError:
            self.say(f"{name} takes {'an integer' if kind is int else 'a number'}, not {value!r}")
            return
        if key == "ctx":
            self.reload(self.llm.name, {"ctx": v})
            return
        if key == "stop":
            changed = self.sampling | {"stop": (*self.sampling.get("stop", ()), v)}
        else:
            changed = self.sampling | {key: v}
        try:
            self.llm.sampling(**changed)
        except LocalLLMError as e:
            self.say(f"error: {e}")
            return
        self.sampling = changed
        self.say(f"Set parameter '{name}' to '{value}'.")

    def show(self, what: str) -> None:
        llm = self.llm
        runner = llm.runner
        if what == "info":
            info = _info(runner.model_path)
            rows = [("model", llm.name), ("backend", runner.name), ("context", str(llm.n_ctx))]
            rows += info
            width = max(len(k) for k, _ in rows)
            self.say("\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows))
        elif what == "parameters":
            given = llm.sampling_defaults | self.sampling  # the model's defaults, then /set's
            rows = [f"  {k:<18} {s!r}" if k == "stop" else f"  {k:<18} {s}"
                    for k, v in given.items() for s in (v if k == "stop" else (v,))]  # fmt: skip
            self.say("\n".join(["Parameters:", *rows]) if rows else "No parameters set: the defaults.")
        elif what == "template":
            tpl = runner.chat_template
            self.say(getattr(tpl, "source", None) or str(tpl))
        elif what == "system":
            self.say(self.system or "No system message set.")
        elif what == "license":
            self.say(_license(runner.model_path) or "No license in the model file.")
        else:
            self.say("Usage: /show info|parameters|template|system|license")

    def load_model(self, name: str) -> None:
        if not name:
            self.say("Usage: /load MODEL")
            return
        self.reload(name, {})

    def reload(self, name: str, changes: dict[str, Any]) -> None:
        """Load `name` with these option changes in place of the model (one in memory at a
        time); when it fails, the model before comes back."""
        try:
            options = self.options.replace(**changes)
        except LocalLLMError as e:
            self.say(f"error: {e}")
            return
        self.say(f"Loading model '{name}'")
        self.llm.close()
        try:
            self.llm, self.options = self.load(name, options), options
        except LocalLLMError as e:
            self.say(f"error: {e}")
            self.llm = self.load(self.llm.name, self.options)

    def save(self, name: str) -> None:
        if not name:
            self.say("Usage: /save NAME")
            return
        from localllm.conversations import ChatSettings, Conversations, image_meta

        with Conversations() as db:
            conv = db.create(self.llm.name, title=name, system_prompt=self.system,
                             settings=ChatSettings(dict(self.sampling)).to_dict())  # fmt: skip
            for m in self.history:
                db.add_message(conv.id, m["role"], m["content"],
                               meta=m.get("meta") or image_meta(m.get("images") or ()))  # fmt: skip
        self.say(f"Saved the conversation as '{name}' (the app opens it: localllm chat, Ctrl+L).")

    # -- the loop ----------------------------------------------------------------------------

    def loop(self, lines: Lines) -> None:
        """Read messages until EOF or /bye; Ctrl-C stops the current answer, not the REPL.

        A Ctrl-C can land anywhere in a turn — while the line is read, in the instant between the
        answer's end and the next prompt (the history update) — so each whole turn is inside one
        `try`: wherever the KeyboardInterrupt is raised, the next prompt comes back."""
        while True:
            try:
                try:
                    text = lines.message()
                except EOFError:
                    print(file=sys.stderr)
                    return
                if not self.handle(text):
                    return
            except KeyboardInterrupt:
                print(file=sys.stderr)


def ask_permission(call: Any, read: Callable[[str], str] = input) -> str:
    """Ask on the terminal whether a tool call may run: "once", "always" (this tool, this
    session) or "deny" (also at end of input)."""
    print(f"The model calls {call.name} {call.arguments}", file=sys.stderr, flush=True)
    while True:
        try:
            answer = read("Allow? [y]es once, [a]lways for this tool, [n]o: ").strip().lower()
        except EOFError:
            return "deny"
        if answer in ("y", "yes", ""):
            return "once"
        if answer in ("a", "always"):
            return "always"
        if answer in ("n", "no"):
            return "deny"


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _info(path: Any) -> list[tuple[str, str]]:
    from localllm.gguf_file import GGUFFile
    from localllm.model_info import human_params, model_info

    try:
        with GGUFFile(path) as gf:
            info = model_info(gf)
    except (LocalLLMError, OSError):
        return []
    return [("architecture", info.architecture), ("parameters", human_params(info.parameters)),
            ("trained context", str(info.context_length)), ("quantization", info.quant)]  # fmt: skip


def _license(path: Any) -> str | None:
    from localllm.gguf_file import GGUFFile

    with contextlib.suppress(LocalLLMError, OSError), GGUFFile(path) as gf:
        keys = ("general.license", "general.license.name", "general.license.link")
        return "\n".join(str(v) for k in keys if (v := gf.get(k))) or None
    return None
