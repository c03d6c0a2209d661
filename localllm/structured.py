"""Grammar-constrained decoding: JSON schemas and forced tool calls, through llguidance.

We do not write a grammar engine: llguidance (Microsoft's, the one llama.cpp and vLLM use) compiles
a JSON schema or a Lark grammar and, at each step, says which tokens may come next. This module
turns a `Request` into a grammar (`grammar_for`), a runner's vocabulary into llguidance's
tokenizer (`vocabulary`, built once per runner), and gives each constrained sequence a
`Constraint`: `mask_numpy(row)` before sampling (every logit the grammar forbids becomes -inf;
the engine's one mask site, on the numpy rows every runner returns), `consume(token)` after. Every
runner samples through the same masks and the same sampler, so `response_format` and
`tool_choice` mean the same thing on each.

- `json_object`: any JSON object. `json_schema`: that schema (llguidance's JSON Schema support:
  nested objects, arrays, enums, numbers with bounds, required/optional, `additionalProperties`).
- `tool_choice` "required" or a named function: one or more (one when `parallel_tool_calls` is
  false) Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks whose
  arguments follow each tool's parameter schema — what `chat.parse_tool_calls` reads back.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

from localllm.errors import LocalLLMError, Unsupported
from localllm.types import Request

MAX_CALLS = 8  # parallel tool calls in one forced answer (a small model may repeat one forever)
_vocabularies: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise Unsupported("constrained decoding needs llguidance: pip install llguidance") from None
    return llguidance


# compact JSON (one space after , and :): a small model given free whitespace often spends its
# tokens on newlines and indentation, and may never close the object
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}


def _tool_call_schema(tools: Any, choice: Any) -> dict[str, Any]:
    fns = [t.get("function", t) for t in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fns = [f for f in fns if f.get("name") == name]
    options = []
    for f in fns:
        params = dict(f.get("parameters") or {"type": "object", "properties": {}})
        # a forced call's arguments hold what the tool declares (unless it says otherwise)
        params.setdefault("additionalProperties", False)
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})  # fmt: skip
    return _compact(options[0] if len(options) == 1 else {"anyOf": options})


def grammar_for(request: Request) -> str | None:
    """The llguidance grammar a request's output must follow, or None when it is free text."""
    rf = request.response_format
    choice = request.tool_choice
    if choice == "required" or isinstance(choice, dict):
        schema = json.dumps(_tool_call_schema(request.tools, choice))
        more = f' ("\\n" call){{0,{MAX_CALLS - 1}}}' if request.parallel_tool_calls else ""
        return f'start: call{more}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"'
    if rf is None or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = rf.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise LocalLLMError("response_format json_schema needs a 'schema' object")
    llg = _llguidance()
    grammar = llg.LLMatcher.grammar_from_json_schema(_compact(schema))
    failed, said = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise LocalLLMError(
            f"the JSON schema cannot be enforced: {said[0] if said else 'invalid'}"[:500]
        )
    return grammar


class Vocabulary:
    """A runner's tokens as llguidance sees them (built once per loaded model: ~0.3 s for 49k)."""

    def __init__(self, runner: Any) -> None:
        llg = _llguidance()
        n = int(runner.n_vocab)
        tokens = []
        for t in range(n):
            piece = runner.token_bytes(t)
            # control tokens have no text: llguidance marks special tokens with a 0xFF byte
            tokens.append(piece if piece else b"\xff<|%d|>" % t)
        ends = [t for t in range(n) if runner.is_end(t)]
        if not ends:
            raise Unsupported(
                "the model has no end-of-generation token, so output cannot be constrained"
            )

        class _Tokens:
            eos_token_id = ends[0]
            bos_token_id = None
            special_token_ids = [i for i, p in enumerate(tokens) if p.startswith(b"\xff")]

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: str | bytes) -> list[int]:
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                return runner.tokenize(text, add_special=False)

        self.n_vocab = n
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Tokens()), eos_token=ends)


def vocabulary(runner: Any) -> Vocabulary:
    """The runner's vocabulary for llguidance, built on first use and kept while the runner lives."""
    with _lock:
        v = _vocabularies.get(runner)
        if v is None:
            v = _vocabularies[runner] = Vocabulary(runner)
        return v


class Constraint:
    """One sequence's grammar state: which tokens may come next; fed every sampled token."""

    def __init__(self, vocab: Vocabulary, grammar: str) -> None:
        import numpy as np

        llg = _llguidance()
        self._np = np
        self.n_vocab = vocab.n_vocab
        self.matcher = llg.LLMatcher(vocab.tokenizer, grammar)
        if self.matcher.is_error():
            raise LocalLLMError(f"the grammar cannot be enforced: {self.matcher.get_error()}"[:500])

    def allowed(self) -> Any:
        """numpy bool (n_vocab,): True where a token may come next."""
        np = self._np
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)
        if not mask.any():
            raise LocalLLMError(
                f"constrained decoding reached a dead end: {self.matcher.get_error() or 'no token fits'}"
            )
        return mask

    def mask_numpy(self, logits: Any) -> None:
        """Set every logit a token may not take to -inf, in place (a runner's row (V,); V may
        exceed the tokenizer's vocabulary, whose extra rows are never allowed)."""
        np = self._np
        allowed = self.allowed()
        n = min(len(logits), self.n_vocab)
        logits[:n][~allowed[:n]] = -np.inf
        logits[n:] = -np.inf

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise LocalLLMError(
                f"constrained decoding rejected token {token}: {self.matcher.get_error()}"[:500]
            )


def constraint_for(runner: Any, request: Request) -> Constraint | None:
    """The request's grammar state on this runner's vocabulary; None when it asks for none."""
    grammar = grammar_for(request)
    return None if grammar is None else Constraint(vocabulary(runner), grammar)
