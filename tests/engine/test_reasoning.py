"""Reasoning apart from the answer (issue 34): the splitter on every split of a stream, and the
engine with a scripted runner whose chat template thinks (Qwen3's switch, R1's opened block)."""

from __future__ import annotations

import itertools

import pytest
from fakebackend import HARMONY_TEMPLATE as HARMONY
from fakebackend import THINKING_TEMPLATE as QWEN3
from fakebackend import FakeRunner

from localllm.chat import CHATML, ChatTemplate
from localllm.engine import Model
from localllm.engine.core import prompt_ids
from localllm.engine.reasoning import Splitter, Thinking, template_args, thinking_of
from localllm.errors import Unsupported
from localllm.types import Request, SamplingParams

THINK = Thinking("<think>", "</think>", switch=True, effort=False)
# DeepSeek-R1's shape: the template opens the block; the output starts inside it
R1 = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    "{# </think> closes it #}"
)


GPT_OSS = Thinking("<|channel|>analysis<|message|>", "<|end|>", switch=False, effort=True,
                   answer="<|channel|>final<|message|>")  # fmt: skip


def split_all(pieces: list[str], inside: bool = False, thinking: Thinking = THINK) -> tuple[str, str]:
    s = Splitter(thinking, inside=inside)
    out = [s.feed(p) for p in pieces] + [s.flush()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("text, inside, want", [
    ("<think>\nLet me see.\n</think>\n\nThe answer.", False, ("Let me see.\n", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("No thinking here.", False, ("", "No thinking here.")),
    ("<thin", False, ("", "<thin")),  # cut off before the marker was whole: it is the answer
    ("Plans.\n</think>\n\nDone", True, ("Plans.\n", "Done")),
    ("still thinking <", True, ("still thinking <", "")),  # never closed: all reasoning
    ("a < b </thinker> c</think>ok", True, ("a < b </thinker> c", "ok")),
    ("x</think>y <think>z</think>", True, ("x", "y <think>z</think>")),  # one block, at the start
])  # fmt: skip
def test_the_splitter_gives_the_same_at_every_split(text: str, inside: bool, want: tuple) -> None:
    assert split_all([text], inside) == want
    for i, j in itertools.combinations(range(len(text) + 1), 2):  # every two-cut split
        assert split_all([text[:i], text[i:j], text[j:]], inside) == want, (i, j)
    assert split_all(list(text), inside) == want  # character by character


@pytest.mark.parametrize("text, want", [
    ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>final<|message|>Hi.",
     ("Plan.", "Hi.")),
    ("<|channel|>final<|message|>Straight away.", ("", "Straight away.")),  # no reasoning this time
    ("<|channel|>analysis<|message|>a <|en b<|end|>", ("a <|en b", "")),  # never answered
    # a tool call after the reasoning is another channel: it stays in the content, whole
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=f<|message|>{}",
     ("x", "<|start|>assistant<|channel|>commentary to=f<|message|>{}")),
])  # fmt: skip
def test_the_splitter_reads_gpt_oss_channels(text: str, want: tuple) -> None:
    assert split_all([text], thinking=GPT_OSS) == want
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert split_all([text[:i], text[i:j], text[j:]], thinking=GPT_OSS) == want, (i, j)


def test_what_a_template_says_about_thinking() -> None:
    assert thinking_of(ChatTemplate(HARMONY)) == GPT_OSS
    assert thinking_of(ChatTemplate(CHATML)) is None
    assert thinking_of(ChatTemplate(QWEN3)) == THINK
    r1 = thinking_of(ChatTemplate(R1))
    assert r1 is not None and not r1.switch
    assert template_args(THINK, None, "m") == {}
    assert template_args(THINK, False, "m") == {"enable_thinking": False}
    assert template_args(THINK, True, "m") == {"enable_thinking": True}
    assert template_args(None, False, "m") == {}  # off on a model that never thinks: nothing to do
    with pytest.raises(Unsupported, match="m does not think"):
        template_args(None, True, "m")
    with pytest.raises(Unsupported, match="no reasoning effort"):
        template_args(THINK, "high", "m")
    with pytest.raises(Unsupported, match="think must be"):
        template_args(THINK, "hard", "m")
    effort = Thinking("<think>", "</think>", switch=False, effort=True)
    assert template_args(effort, "low", "m") == {"reasoning_effort": "low"}


class Thinker(FakeRunner):
    def __init__(self, source: str, n_ctx: int = 256) -> None:
        super().__init__(n_ctx=n_ctx)
        self.chat_template = ChatTemplate(source)


def chat(text: str, **kw: object) -> Request:
    return Request(messages=({"role": "user", "content": text},),
                   sampling=SamplingParams(temperature=0), **kw)  # type: ignore[arg-type]  # fmt: skip


def test_the_engine_streams_reasoning_apart_from_the_answer() -> None:
    with Model(Thinker(QWEN3), "qwen3-fake") as m:
        stream = m.submit(chat("say:<think>\nFirst, 2+2.\nIt is 4.\n</think>\n\nFour."))
        chunks = list(stream)
        result = stream.result
        assert result.text == "Four." and result.reasoning == "First, 2+2.\nIt is 4.\n"
        assert "".join(c.reasoning for c in chunks) == result.reasoning
        assert "".join(c.text for c in chunks) == result.text
        assert sum(bool(c.reasoning) for c in chunks) > 3  # it streamed, not at the end
        assert "think" not in result.text
        # think: false reaches the template (an empty block) and keeps reasoning out
        ids, _ = prompt_ids(m.runner, chat("hi", think=False))
        assert m.runner.detokenize(ids).endswith("<think>\n\n</think>\n\n")
        off = m.submit(chat("say:<think>hm</think>Fine.", think=False)).wait()
        assert off.text == "Fine." and off.reasoning is None
        plain = m.submit(chat("say:Just this.")).wait()  # a thinking model that did not think
        assert plain.text == "Just this." and plain.reasoning is None


def test_a_template_that_opens_the_block_starts_inside_it() -> None:
    with Model(Thinker(R1), "r1-fake") as m:
        r = m.submit(chat("say:Hmm, hello.\n</think>\n\nHello!")).wait()
        assert (r.reasoning, r.text) == ("Hmm, hello.\n", "Hello!")
        msgs = ({"role": "user", "content": "say:Thinking on and on"},)
        cut = m.submit(Request(messages=msgs, sampling=SamplingParams(max_tokens=5))).wait()
        assert cut.finish_reason == "length" and cut.text == "" and cut.reasoning == "Think"


def test_think_on_a_model_that_does_not_think_is_one_line() -> None:
    with Model(FakeRunner(n_ctx=256), "plain") as m:
        with pytest.raises(Unsupported, match="plain does not think"):
            m.submit(chat("hi", think=True))
        r = m.submit(chat("say:ok", think=False)).wait()  # nothing to switch off
        assert r.text == "ok" and r.reasoning is None


def test_gpt_oss_channels_stream_apart_and_effort_reaches_the_template() -> None:
    with Model(Thinker(HARMONY, n_ctx=512), "gpt-oss-fake") as m:
        said = ("say:<|channel|>analysis<|message|>User asks. Answer 4.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>4.")  # fmt: skip
        stream = m.submit(Request(messages=({"role": "user", "content": said},), think="high",
                                  sampling=SamplingParams(temperature=0, max_tokens=150)))  # fmt: skip
        chunks = list(stream)
        r = stream.result
        assert (r.reasoning, r.text) == ("User asks. Answer 4.", "4.")
        assert "".join(c.reasoning for c in chunks) == r.reasoning
        assert "".join(c.text for c in chunks) == "4."
        ids, _ = prompt_ids(m.runner, chat("hi", think="high"))
        assert "Reasoning: high" in m.runner.detokenize(ids)
        direct = m.submit(chat("say:<|channel|>final<|message|>Yes.")).wait()
        assert (direct.reasoning, direct.text) == (None, "Yes.")
