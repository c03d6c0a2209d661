"""Chat templates render like llama-cpp-python's formatter, and hostile ones are stopped in time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.chat import (
    CHATML,
    WALL_LIMIT_S,
    ChatTemplate,
    _cpu_seconds,
    parse_tool_calls,
    render_limited,
    repeats_call,
)
from localllm.errors import TemplateError
from localllm.gguf_file import read_gguf

from conftest import need

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and ünïcödé? <b>&</b>"}],
]  # fmt: skip


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_default_template_renders_like_llama_cpp_python(
    default_model_path: Path, messages: list
) -> None:
    need("llama_cpp", "pip install -e '.[dev]'")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    source = read_gguf(default_model_path).metadata["tokenizer.chat_template"]
    theirs = Jinja2ChatFormatter(source, eos_token="<|im_end|>", bos_token="<|im_start|>")(
        messages=messages
    ).prompt
    ours = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>").render(messages)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_chatml_fallback() -> None:
    out = ChatTemplate(CHATML).render([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_reach_templates_that_know_them_and_others_get_a_system_prompt() -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    aware = ChatTemplate(
        "{% for t in tools %}{{ t.function.name }}{% endfor %}|{{ messages[0].content }}"
    )
    assert aware.render([{"role": "user", "content": "x"}], tools=tools) == "get_weather|x"
    plain = ChatTemplate(CHATML).render([{"role": "user", "content": "x"}], tools=tools)
    assert (
        "<tools>" in plain
        and "get_weather" in plain
        and plain.index("system") < plain.index("user")
    )


def test_helpers_real_templates_use() -> None:
    t = ChatTemplate(
        "{{ messages|tojson }}|{{ strftime_now('%Y') }}|{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}"
    )
    out = t.render([{"role": "user", "content": "é<"}], add_generation_prompt=False)
    assert out.startswith('[{"role": "user", "content": "é<"}]|2')
    with pytest.raises(TemplateError, match="refused: no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([{"role": "user", "content": ""}])


HOSTILE = {
    # CVE-2024-34359: reach os through the object graph
    "cve-2024-34359": "{% for x in ().__class__.__base__.__subclasses__() %}{% if 'warning' in x.__name__ %}"
    "{{ x()._module.__builtins__['__import__']('os').system('touch /tmp/localllm-pwned') }}{% endif %}{% endfor %}",
    "attr filter": "{{ ''|attr('__class__')|attr('__mro__') }}",
    "globals": "{{ raise_exception.__globals__ }}",
    "mutate": "{% set x = [] %}{{ x.append(1) }}",
    "nested loop bomb": "{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    "gigabyte string": "{{ 'a' * 10**9 }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "output flood": "{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}",
    "format width": "{{ '%1000000000d' % 1 }}",
    "center width": "{{ 'a'|center(1000000000) }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "syntax error": "{% for %}",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_templates_are_stopped(case: str) -> None:
    marker = Path("/tmp/localllm-pwned")
    marker.unlink(missing_ok=True)
    t0 = time.monotonic()
    with pytest.raises(TemplateError) as exc:
        ChatTemplate(HOSTILE[case], time_limit=2.0).render([{"role": "user", "content": "hi"}])
    elapsed = time.monotonic() - t0
    assert elapsed < WALL_LIMIT_S, f"{case} took {elapsed:.1f}s"
    assert "\n" not in str(exc.value)
    assert not marker.exists()  # nothing executed


def test_the_limit_counts_the_childs_cpu_not_the_clock() -> None:
    """A busy machine (sixteen requests at once on two cores) slows a render without it spinning:
    the limit reads the child's CPU time, so a sleeping child has used none and a spinning one its share."""
    code = "import time, sys\nt = time.monotonic()\nwhile time.monotonic() - t < 0.4: pass\nsys.stdin.read()"
    spinner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        time.sleep(0.1)
        idle = _cpu_seconds(sleeper.pid)
        deadline = time.monotonic() + 30
        while (used := _cpu_seconds(spinner.pid)) is not None and used < 0.3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert idle is not None and idle < 0.3
        assert used is not None and used >= 0.3
    finally:
        for p in (spinner, sleeper):
            p.communicate(b"")
    assert _cpu_seconds(spinner.pid) is None  # reaped: nothing to read


def test_the_rendering_child_does_not_collect_the_heap_it_inherited() -> None:
    """A full cyclic collection in the child walks every object of the parent, copying each page
    it touches (measured: 1.1 s of a child's CPU under a parent of 3 million containers), and in
    the test suite's big process 2 s of it stopped an honest template. The child renders with
    the collector off; the parent's stays on."""
    import gc

    assert render_limited("{{ probe() }}", {"probe": gc.isenabled}) == "False"
    assert gc.isenabled()


def test_process_stays_responsive_after_a_bomb() -> None:
    with pytest.raises(TemplateError, match="longer than"):
        render_limited(HOSTILE["nested loop bomb"], {"messages": []}, time_limit=0.5)
    assert render_limited("{{ 1 + 1 }}", {}) == "2"


# -- tool calls --------------------------------------------------------------------------------


def _calls(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
         [("get_weather", {"city": "Paris"})]),
        ('Let me check.<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
         "Let me check.", [("a", {}), ("b", {"x": 1})]),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
        ('<|python_tag|>{"name": "f", "parameters": {"q": "x"}}; {"name": "g", "parameters": {}}', "",
         [("f", {"q": "x"}), ("g", {})]),
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", {"a": 1, "b": 2})]),
        ('[TOOL_CALLS]add[ARGS]{"a": 1}', "", [("add", {"a": 1})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>', "", [("f", {"k": 2})]),
    ],
)  # fmt: skip
def test_tool_call_formats(text: str, content: str, calls: list) -> None:
    assert _calls(text) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '[TOOL_CALLS] [{"name": 3}]',
        '{"name": "x"} is how you write JSON',
        "Just a normal answer.",
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    ],
)
def test_malformed_tool_calls_stay_text(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


W = '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'
T = '<tool_call>\n{"name": "t", "arguments": {}}\n</tool_call>'


def test_repeated_calls_come_back_once_and_a_call_cut_short_is_dropped() -> None:
    # a small model repeats a forced call until the token limit (issue 39: instructor and
    # pydantic-ai got the markup as content with finish "length")
    assert _calls("\n".join([W, T, W, T])) == ("", [("w", {"city": "Paris"}), ("t", {})])
    cut = "\n".join([W, '<tool_call>\n{"name": "t", "argu'])
    assert _calls(cut) == ('<tool_call>\n{"name": "t", "argu', [("w", {"city": "Paris"})])  # not cut: text
    content, calls = parse_tool_calls(cut, cut=True)
    assert content == "" and [c.name for c in calls] == ["w"]
    content, calls = parse_tool_calls('Checking. <tool_call>\n{"name": "t"', cut=True)
    assert (content, calls) == ("Checking. ", [])  # no complete call: the markup still never shows
    assert parse_tool_calls("a < b", cut=True) == ("a < b", [])


def test_a_repeated_call_is_seen_when_it_closes() -> None:
    assert not repeats_call(W) and not repeats_call(W + T)
    assert not repeats_call(W + T + W[:-3])  # not closed yet
    assert repeats_call(W + T + W) and repeats_call(W + W)
    assert not repeats_call(W + W.replace("Paris", "Rome"))


def test_tool_call_round_trip_to_openai_shape() -> None:
    _, [call] = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"a": [1, "b"]}}</tool_call>'
    )
    d = call.to_openai()
    assert d["type"] == "function" and d["id"].startswith("call_")
    assert (
        json.loads(d["function"]["arguments"]) == {"a": [1, "b"]} and d["function"]["name"] == "f"
    )
