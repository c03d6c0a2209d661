"""Chat templates from model files, rendered safely; tool calls parsed back out of model output.

A `tokenizer.chat_template` is code from a stranger (llama-cpp-python CVE-2024-34359 rendered it
unsandboxed). Here it renders in jinja2's ImmutableSandboxedEnvironment, and — because the sandbox
alone lets `{% for %}` nests run forever and `'a'*10**9` allocate a gigabyte — in a forked child
process with a wall-clock limit, an address-space limit and an output cap. A failure of any kind
is one `TemplateError`; the parent process never runs template code at all.
"""

from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from localllm.errors import TemplateError
from localllm.types import Message, ToolCall

TIME_LIMIT_S = 2.0  # of the rendering child's user CPU time (wall time where it cannot be read)
WALL_LIMIT_S = 30.0  # however busy the machine, no render waits longer
MAX_OUTPUT = 1 << 20  # 1 MiB of rendered prompt
MEMORY_HEADROOM = 512 << 20  # the child may grow this much beyond the parent's address space
MAX_REPEAT = 1 << 20  # 'x' * n and friends may build at most this many items

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# -- rendering (runs in the child) -------------------------------------------------------------


def _environment():  # noqa: ANN202 - jinja2 is imported only where templates render
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with arithmetic that cannot build giant values in one step."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 128:
                raise SecurityError("exponent too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if (
                        isinstance(seq, (str, list, tuple))
                        and isinstance(n, int)
                        and len(seq) * n > MAX_REPEAT
                    ):
                        raise SecurityError("repetition too large")
            if operator == "%" and isinstance(left, str) and re.search(r"%[-+ #0]*\d{7,}", left):
                raise SecurityError("format width too large")
            return super().call_binop(context, operator, left, right)

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # the stock sandbox renders unsafe attributes as empty; say no out loud instead
            raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} is not allowed")

        def format_string(self, s: str, args: Any, kwargs: Any, format_func: Any = None) -> str:
            if re.search(r"\d{7,}", s):
                raise SecurityError("format width too large")
            return super().format_string(s, args, kwargs, format_func)

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(message: str) -> None:
        raise TemplateError(f"the chat template refused: {message}")

    def tojson(x: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False,
               ensure_ascii: bool = False) -> str:  # fmt: skip
        # as Hugging Face transformers does, not jinja's HTML-escaping tojson
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def bounded(f: Any) -> Any:
        def g(value: Any, width: Any = 80, *a: Any, **kw: Any) -> Any:
            if isinstance(width, int) and width > MAX_REPEAT:
                raise SecurityError("width too large")
            return f(value, width, *a, **kw)

        return g

    env.filters["tojson"] = tojson
    for name in ("center", "indent"):
        env.filters[name] = bounded(env.filters[name])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render_here(source: str, context: dict[str, Any], max_output: int = MAX_OUTPUT) -> str:
    """Render in this process (sandboxed, output-capped, but no time or memory limit)."""
    from jinja2.exceptions import SecurityError
    from jinja2.exceptions import TemplateError as JinjaError

    try:
        template = _environment().from_string(source)
        out: list[str] = []
        size = 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_output:
                raise TemplateError(f"the chat template produced more than {max_output} characters")
            out.append(piece)
        return "".join(out)
    except SecurityError as e:
        raise TemplateError(f"the chat template tried something unsafe: {e}") from None
    except JinjaError as e:
        raise TemplateError(f"the chat template failed: {e}") from None


def _child(source: str, context: dict[str, Any], max_output: int, fd: int) -> None:
    import resource

    status, body = b"E", b""
    try:
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_HEADROOM, vm + MEMORY_HEADROOM))
    except (OSError, ValueError):
        pass  # no /proc (macOS): the time limit still holds
    try:
        status, body = (
            b"K",
            render_here(source, context, max_output).encode("utf-8", "surrogatepass"),
        )
    except TemplateError as e:
        body = str(e).encode()
    except MemoryError:
        body = b"the chat template used too much memory"
    except RecursionError:
        body = b"the chat template recursed too deeply"
    except Exception as e:  # noqa: BLE001 - anything a template raises is the template's failure
        body = f"the chat template failed: {type(e).__name__}: {e}".encode()
    view = memoryview(status + body)
    while view:
        view = view[os.write(fd, view) :]


def _cpu_seconds(pid: int) -> float | None:
    """User CPU time a child has used so far (Linux /proc), None where that cannot be read. Not
    the kernel's time on its behalf: a forked child of a large process pays for its copied
    pages there, more the more children fork at once (16 streams on 2 cores once passed 2 s
    rendering ChatML); a template that spins spins in user time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def render_limited(
    source: str,
    context: dict[str, Any],
    *,
    time_limit: float = TIME_LIMIT_S,
    max_output: int = MAX_OUTPUT,
) -> str:
    """Render in a forked child killed once it has spent `time_limit` of CPU; the parent only reads a pipe.

    CPU rather than wall time: sixteen requests forking at once on two cores must not stop an
    honest template (CI saw that); a template that spins uses its CPU and is stopped on time."""
    if not hasattr(os, "fork"):  # pragma: no cover - Windows: sandbox and output cap only
        return render_here(source, context, max_output)
    r, w = os.pipe()
    # Ctrl-C is the parent's: held back over the fork (no handler runs inside fork's callbacks,
    # and none in the child, which a terminal's Ctrl-C reaches too, being in its process group),
    # ignored by the child, delivered to the parent once the fork is done.
    sigint = {signal.SIGINT}
    masked = hasattr(signal, "pthread_sigmask")
    if masked:
        signal.pthread_sigmask(signal.SIG_BLOCK, sigint)
    pid = os.fork()
    if pid == 0:  # the child: render, write, leave without running any parent cleanup
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a pending one is dropped
            if masked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, sigint)
            # No cyclic collection here: a full one walks every object the child inherited, each
            # page it touches copied, and in a big process (a test suite's, a server's with torch
            # loaded) that cost the child seconds of CPU: an honest template was stopped
            gc.disable()
            os.close(r)
            _child(source, context, max_output, w)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    if masked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigint)
    os.close(w)
    chunks: list[bytes] = []
    start = time.monotonic()
    deadline = start + time_limit
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                used = _cpu_seconds(pid)
                if (
                    used is not None
                    and used < time_limit
                    and time.monotonic() - start < WALL_LIMIT_S
                ):
                    deadline = time.monotonic() + max(time_limit - used, 0.05)
                    continue  # a busy machine slowed it, the template did not spin: wait on
                os.kill(pid, signal.SIGKILL)
                raise TemplateError(
                    f"the chat template ran longer than {time_limit:g} s and was stopped"
                )
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                data = os.read(r, 1 << 16)
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    raw = b"".join(chunks)
    if raw[:1] == b"K":
        return raw[1:].decode("utf-8", "surrogatepass")
    raise TemplateError(raw[1:].decode("utf-8", "replace") or "the chat template crashed")


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template with the tokens it refers to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    time_limit: float = TIME_LIMIT_S
    max_output: int = MAX_OUTPUT
    origin: str = "model file"  # or "<family> family (built in)", or "plain text"
    note: str = ""  # said once to the user when the template is not the file's own

    @property
    def supports_tools(self) -> bool:
        return "tools" in self.source

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] = (),
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        msgs = [dict(m) for m in messages]
        context: dict[str, Any] = {
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        if tools:
            if self.supports_tools:
                context["tools"] = list(tools)
            else:  # the template knows nothing of tools: describe them the Hermes way
                context["messages"] = _with_tool_system_prompt(msgs, tools)
        for m in context["messages"]:
            if m.get("content") is None:
                m["content"] = ""
        return render_limited(
            self.source, context, time_limit=self.time_limit, max_output=self.max_output
        )


# Templates for architectures whose files may lack one: the family's own format, as in llama.cpp's
# built-in list (llama-chat.cpp). An architecture shared by many chat formats (llama: Llama 2,
# Llama 3, Mistral, SmolLM's ChatML) has none here: guessing wrong is worse than plain text.
GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] + '\\n\\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' + (sys if loop.first else '') + message['content']"
    " + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
PLAIN = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}{{ '\n\n' }}{% endif %}{% endfor %}"
)
FAMILY_TEMPLATES = {
    "gemma": ("gemma", GEMMA), "gemma2": ("gemma", GEMMA), "gemma3": ("gemma", GEMMA),
    "gemma3n": ("gemma", GEMMA), "phi3": ("phi3", PHI3),
    "qwen2": ("chatml", CHATML), "qwen2moe": ("chatml", CHATML), "qwen3": ("chatml", CHATML),
    "qwen3moe": ("chatml", CHATML),
}  # fmt: skip


def template_for(metadata: Any, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """The chat template a model's messages render with: the file's own; else its architecture's
    family template; else plain text (messages joined by blank lines), with a note saying so."""
    own = metadata.get("tokenizer.chat_template")
    if isinstance(own, str) and own.strip():
        return ChatTemplate(own, bos_token=bos_token, eos_token=eos_token)
    arch = str(metadata.get("general.architecture") or "unknown")
    if arch in FAMILY_TEMPLATES:
        family, source = FAMILY_TEMPLATES[arch]
        return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token,
                            origin=f"{family} family (built in)",
                            note=f"the file has no chat template; using the {family} format of "
                                 f"its architecture ({arch})")  # fmt: skip
    return ChatTemplate(PLAIN, bos_token=bos_token, eos_token=eos_token, origin="plain text",
                        note=f"the file has no chat template and its architecture ({arch}) has no "
                             "single format: messages are sent as plain text")  # fmt: skip


def _with_tool_system_prompt(
    messages: list[Message], tools: Sequence[dict[str, Any]]
) -> list[Message]:
    described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    text = (
        "You may call functions. The available functions, one JSON schema per line:\n"
        f"<tools>\n{described}\n</tools>\n"
        'To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    )
    if messages and messages[0].get("role") == "system":
        return [
            {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{text}"},
            *messages[1:],
        ]
    return [{"role": "system", "content": text}, *messages]


# -- tool calls --------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


TOOL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{")  # how a call's markup starts


class ToolHold:
    """Holds streamed text back while it may be the start of a tool call, so a reader sees either
    the answer or the calls, never the raw markup of a call. Text that is clearly an answer flows."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.held = ""
        self.sent = ""

    def feed(self, text: str) -> str:
        if not self.active:
            self.sent += text
            return text
        self.held += text
        head = self.held.lstrip()
        if not head:
            return ""
        if any(head.startswith(m) or m.startswith(head) for m in TOOL_MARKERS):
            return ""  # may be a call: decide at the end
        out, self.held, self.active = self.held, "", False
        self.sent += out
        return out

    def rest(self, text: str, calls: bool) -> str:
        """At the end, what is still to show of the answer `text` (the result's, calls parsed
        out): with calls, the text beside them if it was held; else what was held back."""
        if calls:
            return text if self.held.strip() and text else ""
        if not self.held:
            return ""
        return text[len(self.sent) :] if text.startswith(self.sent) else self.held


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _as_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(objs: list[Any]) -> list[ToolCall] | None:
    calls = [_as_call(o) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _unique(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls without repeats (same name and arguments): a small model often writes one call
    again and again until it is stopped."""
    seen: set[tuple[str, str]] = set()
    out = []
    for c in calls:
        if (c.name, c.arguments) not in seen:
            seen.add((c.name, c.arguments))
            out.append(c)
    return out


def repeats_call(text: str) -> bool:
    """Whether the last complete `<tool_call>` block of `text` repeats an earlier one."""
    bodies = [_json(b) for b in _HERMES.findall(text)]
    return len(bodies) > 1 and bodies[-1] is not None and bodies[-1] in bodies[:-1]


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    """Split model output into (content, tool calls) for Hermes/Qwen `<tool_call>`, Llama 3 JSON
    and Mistral `[TOOL_CALLS]` outputs; repeated calls come back once. Anything malformed stays
    plain text with no calls. `cut`: the output was cut short (a token limit), so an unclosed
    `<tool_call>` at its end is a call that never finished — dropped, not made content."""
    if "<tool_call>" in text:
        start = text.rfind("<tool_call>")
        if cut and "</tool_call>" not in text[start:]:
            text = text[:start]
        bodies = _HERMES.findall(text)
        calls = _calls([_json(b) for b in bodies]) if bodies else None
        if calls:
            return _HERMES.sub("", text).strip(), _unique(calls)
        return text, []
    stripped = text.strip()
    if stripped.startswith(_MISTRAL):
        body = stripped[len(_MISTRAL) :].strip()
        if "[ARGS]" in body:  # newer Mistral: name[ARGS]{json}, possibly repeated
            parts = [p for p in body.split(_MISTRAL) if p.strip()]
            objs = []
            for p in parts:
                name, _, args = p.partition("[ARGS]")
                objs.append({"name": name.strip(), "arguments": _json(args.strip())})
            calls = _calls(objs)
        else:
            data = _json(body)
            calls = _calls(data if isinstance(data, list) else [data])
        return ("", calls) if calls else (text, [])
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG) :].strip()
    if stripped.startswith("{") and ('"name"' in stripped):
        pieces = re.split(r"\}\s*;\s*\{", stripped)
        if len(pieces) > 1:
            pieces = [pieces[0] + "}", *["{" + p + "}" for p in pieces[1:-1]], "{" + pieces[-1]]
        objs = [_json(p) for p in pieces]
        if all(isinstance(o, dict) and ("parameters" in o or "arguments" in o) for o in objs):
            calls = _calls(objs)
            if calls:
                return "", calls
    return text, []
