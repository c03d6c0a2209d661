"""Reasoning apart from the answer.

A model that thinks writes its reasoning between markers before it answers: `<think>…</think>`
(Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3), `[THINK]…[/THINK]` (Magistral), and
gpt-oss's harmony channels: `<|channel|>analysis<|message|>…<|end|>`, then the answer behind
`<|start|>assistant<|channel|>final<|message|>` (llama.cpp's detokenizer writes these tokens out,
and so does ours). Some templates open the block themselves (the generation prompt ends in
`<think>\\n`): the output then starts inside it. `Splitter` separates a streamed text into
reasoning and content, holding back only what could still be the start of a marker, as
`StopMatcher` does for stop strings.

Whether a model thinks is read from its chat template: it names a marker. Whether thinking can be
switched is read from it too: it takes `enable_thinking` (Qwen3, SmolLM3). A request's `think`
(None: the model's own default) reaches the template as `enable_thinking`; `think: true` on a
model whose template names no marker is refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localllm.errors import Unsupported

# (opens the reasoning, closes it, opens the answer: what comes between the close and it is neither)
MARKERS = (
    ("<think>", "</think>", ""),
    ("[THINK]", "[/THINK]", ""),
    ("<|channel|>analysis<|message|>", "<|end|>", "<|channel|>final<|message|>"),
)
EFFORTS = ("low", "medium", "high")  # `think` levels, for templates that take `reasoning_effort`


@dataclass(frozen=True)
class Thinking:
    """What a chat template says about thinking."""

    open: str
    close: str
    switch: bool  # the template takes `enable_thinking`
    effort: bool  # the template takes `reasoning_effort`
    answer: str = ""  # the marker that opens the answer ("": the answer follows the close)


def thinking_of(template: Any) -> Thinking | None:
    """The thinking a template supports (None: the model does not think)."""
    source = getattr(template, "source", "") or ""
    for open_, close, answer in MARKERS:
        if open_ in source and close in source:
            return Thinking(open_, close, "enable_thinking" in source,
                            "reasoning_effort" in source, answer)  # fmt: skip
    return None


def template_args(thinking: Thinking | None, think: bool | str | None, model: str) -> dict[str, Any]:
    """The chat template's variables for a request's `think`; refuses what the model cannot do."""
    if think is None:
        return {}
    if isinstance(think, str) and think not in EFFORTS:
        raise Unsupported(f"think must be true, false or one of {', '.join(EFFORTS)}, not {think!r}")
    if thinking is None:
        if think is False:
            return {}
        raise Unsupported(f"{model} does not think (its chat template has no thinking block)")
    args: dict[str, Any] = {}
    if thinking.switch:
        args["enable_thinking"] = think is not False
    if isinstance(think, str):
        if not thinking.effort:
            raise Unsupported(f"{model}'s chat template takes no reasoning effort ({think!r})")
        args["reasoning_effort"] = think
    return args


class Splitter:
    """Streamed text → (reasoning, content) pieces. Leading whitespace before an opening marker and
    what comes between the closing marker and the answer (whitespace, or up to the answer's own
    marker) belong to neither; where that marker never comes, the text after the close is the
    answer (gpt-oss calling a tool writes another channel)."""

    def __init__(self, thinking: Thinking, *, inside: bool = False) -> None:
        self.open, self.close, self.answer = thinking.open, thinking.close, thinking.answer
        # start → opened → inside → gap → after, or start → after
        self.state = "opened" if inside else "start"
        self.pending = ""

    @classmethod
    def for_prompt(cls, thinking: Thinking, prompt: str) -> Splitter:
        """Inside the block from the start when the rendered prompt opened it."""
        return cls(thinking, inside=prompt.rstrip().endswith(thinking.open))

    def feed(self, piece: str) -> tuple[str, str]:
        buf = self.pending + piece
        self.pending = ""
        reasoning = content = ""
        while buf:
            if self.state == "start":
                lead = buf.lstrip()
                if lead.startswith(self.open):
                    self.state, buf = "opened", lead[len(self.open) :]
                elif self.answer and lead.startswith(self.answer):  # no reasoning this time
                    self.state, buf = "after", lead[len(self.answer) :]
                elif self.open.startswith(lead) or self.answer.startswith(lead):
                    self.pending = buf  # could still become a marker
                    return reasoning, content
                else:
                    self.state = "after"
            elif self.state == "opened":  # the newlines after the opening marker
                buf = buf.lstrip("\n")
                if buf:
                    self.state = "inside"
            elif self.state == "inside":
                at = buf.find(self.close)
                if at >= 0:
                    reasoning += buf[:at]
                    self.state, buf = "gap", buf[at + len(self.close) :]
                    continue
                hold = _partial(buf, self.close)
                reasoning += buf[: len(buf) - hold]
                self.pending = buf[len(buf) - hold :]
                return reasoning, content
            elif self.state == "gap" and self.answer:  # up to the answer's marker
                at = buf.find(self.answer)
                if at < 0:
                    self.pending = buf
                    return reasoning, content
                self.state, buf = "after", buf[at + len(self.answer) :]
            elif self.state == "gap":  # the whitespace between the block and the answer
                buf = buf.lstrip()
                if buf:
                    self.state = "after"
            else:
                content += buf
                buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What was held back: reasoning when the block never closed, else content."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.thinking else ("", rest)

    @property
    def thinking(self) -> bool:
        return self.state in ("opened", "inside")


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
