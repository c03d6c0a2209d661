"""What a draft head is trained on (issue 36): the model's own answers to built-in prompts
(self-distillation: the head learns the text it will draft) and any texts the user gives.

    training_text(llm, files, budget) -> token ids    the conversations (template and all, as
                                                      the model sees them when it decodes), then
                                                      each file's tokens
    keep_text(path, digest, ids, seconds)             the text of a run in progress, so that a
    kept_text(path, digest) -> (ids, seconds) | None  resumed run trains on the same text
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from localllm.engine.core import prompt_ids
from localllm.errors import LocalLLMError
from localllm.types import Request, SamplingParams

__all__ = ["PROMPTS", "TASKS", "TOPICS", "head_info", "keep_text", "kept_text", "training_text"]

# Everyday chat requests of the kinds users send (explain, list, write, rewrite, reason, code);
# the model's answers to them are what a head drafts most.
PROMPTS: tuple[str, ...] = (
    "Explain how a rainbow forms.", "What is the difference between weather and climate?",
    "Give me three tips for sleeping better.", "Write a short poem about the sea.",
    "How do I boil an egg?", "What causes the seasons?", "Summarize the story of Cinderella.",
    "List five fruits that are high in vitamin C.", "What is photosynthesis?",
    "Write a haiku about autumn.", "How does a compass work?",
    "Explain what a computer's memory does.", "What are the planets of the solar system?",
    "Write a Python function that reverses a string.", "What is a prime number? Give examples.",
    "How do vaccines work?", "Suggest a name for a friendly robot and explain it.",
    "What should I pack for a weekend camping trip?", "Explain recursion to a child.",
    "Write a thank-you note to a teacher.", "Why is the sky blue?",
    "How can I improve my handwriting?", "Describe a cat to someone who has never seen one.",
    "What is the water cycle?", "Give me a recipe for pancakes.",
    "Write a short story about a lost key.", "What are the benefits of reading books?",
    "How does the internet work, in simple terms?", "Translate 'good morning' into French, "
    "Spanish and German.", "What is gravity?", "Write a limerick about a dog.",
    "How do I make a budget?", "Explain the rules of chess briefly.",
    "What is the capital of Japan, and what is it known for?", "Write a SQL query that counts "
    "rows in a table named users.", "What makes a good friend?", "How do bees make honey?",
    "Give me a plan for learning to play the guitar.", "Explain what an atom is.",
    "Write an email asking for a day off.", "What are some ways to save water at home?",
    "How does a plant grow from a seed?", "Describe your ideal weekend.",
    "What is the difference between a list and a tuple in Python?", "Why do we dream?",
    "Write a motivational message for a student before an exam.",
    "How do airplanes fly?", "Tell me a fun fact about octopuses.",
)  # fmt: skip
# ... then every task about every topic, interleaved (topic i with task i, i + 1, ...), so that
# a budget that stops early still covers every task and many topics
TOPICS: tuple[str, ...] = (
    "volcanoes", "the moon", "honeybees", "the printing press", "electric cars", "coral reefs",
    "the Roman Empire", "jazz music", "black holes", "the human heart", "rain forests",
    "chocolate", "the stock market", "earthquakes", "penguins", "the piano", "solar panels",
    "the Great Wall of China", "sleep", "coffee", "dinosaurs", "the Olympic Games", "glaciers",
    "the immune system", "video games", "bread baking", "castles", "the French Revolution",
    "tigers", "smartphones", "recycling", "the Amazon river", "yoga", "chess", "comets",
    "the telephone", "friendship", "deserts", "sailing ships", "ancient Egypt", "whales",
    "public libraries", "wind turbines", "the Renaissance", "mushrooms", "hurricanes",
    "the violin", "trains", "tea", "the brain", "mountains", "kites", "the Internet",
    "gardening", "owls", "the ocean tides", "money", "photography", "clouds", "robots",
)  # fmt: skip
TASKS: tuple[str, ...] = (
    "Explain {} to a curious ten-year-old.", "Give me five interesting facts about {}.",
    "Write a short poem about {}.", "What are the pros and cons of {}?",
    "Write a short story that involves {}.", "Summarize the history of {} in a few sentences.",
    "What are common misconceptions about {}?", "Write a blog post introduction about {}.",
    "Describe {} in three paragraphs.", "What questions would you ask an expert on {}?",
)  # fmt: skip
PROMPTS = PROMPTS + tuple(TASKS[(i + j) % len(TASKS)].format(TOPICS[i])
                          for j in range(len(TASKS)) for i in range(len(TOPICS)))  # fmt: skip


def training_text(llm: Any, files: Sequence[Path], budget: int,
                  say: Callable[[str], None] | None = None,
                  until: float | None = None) -> list[int]:  # fmt: skip
    """Token ids to train `llm`'s draft head on: its answers to PROMPTS (sampled at temperature
    0.7 with a seed per prompt) until they hold `budget` tokens (0: none) or `time.monotonic()`
    passes `until`, then the files' text.

    Raises:
        LocalLLMError: a file that cannot be read (one line naming it).
    """
    texts = []
    for path in files:  # read first: a file that cannot be read costs no generation
        try:
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise LocalLLMError(f"{path}: cannot read it ({e.strerror or e})") from None
    ids: list[int] = []
    if budget > 0:
        requests = [Request(messages=({"role": "user", "content": p},),
                            sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=i,
                                                    max_tokens=min(256, budget)))
                    for i, p in enumerate(PROMPTS)]  # fmt: skip
        n, ahead = 0, 4 * max(1, llm.parallel)  # enough in flight that every slot stays busy
        for at in range(0, len(requests), ahead):
            batch = requests[at : at + ahead]
            streams = [llm.submit(r) for r in batch]
            for r, s in zip(batch, streams):
                result = s.wait()
                if result.error:
                    raise LocalLLMError(f"while writing the training text: {result.error}")
                prompt, _ = prompt_ids(llm.runner, r, llm.name)
                ids += [*prompt, *result.token_ids]
                n += len(result.token_ids)
            if say is not None:
                say(f"self-distillation: {n:,} answer tokens of {budget:,}")
            if n >= budget or (until is not None and time.monotonic() > until):
                break
    for text in texts:
        ids += llm.tokenize(text, add_special=False)
    return ids


def head_info(path: Path, digest: str) -> dict[str, Any] | None:
    """What a stored draft head says of itself (steps, tokens, seconds, held-out agreement; or
    where a published one came from),
    read from its safetensors header alone (no torch): None where there is none, {"error": why}
    where the file is not a head of this model."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 1 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        meta = json.loads(header["__metadata__"]["localllm"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return {"error": f"{path.name}: not a draft head ({type(e).__name__})"}
    if not isinstance(meta, dict) or meta.get("digest") != digest:
        return {"error": f"{path.name}: not a draft head of this model"}
    return {k: meta.get(k) for k in ("step", "tokens", "seconds", "agree", "source")}


def keep_text(path: Path, digest: str, ids: Sequence[int], seconds: float) -> None:
    """The training text of a run (and the seconds writing it took) at `path`, for a resumed
    run: a temporary file, fsynced, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"digest": digest, "seconds": seconds, "ids": list(ids)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def kept_text(path: Path, digest: str) -> tuple[list[int], float] | None:
    """What `keep_text` kept for the model `digest`; None where nothing (readable) is there."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ids, seconds = data["ids"], float(data["seconds"])
        if data["digest"] != digest or not all(isinstance(i, int) for i in ids):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ids, seconds
