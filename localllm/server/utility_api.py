"""llama.cpp's server utility routes, in its shapes, for the editors and tools written against it:
`POST /tokenize` (`content`, `add_special`, `with_pieces`), `POST /detokenize` (`tokens`),
`POST /apply-template` (`messages`, `tools` → the prompt text the model reads), `POST /infill`
(fill in the middle: `input_prefix`, `input_suffix`, `input_extra` files, `prompt`, and the
completion fields; answered as llama.cpp's `/completion`, streamed as its SSE), `GET /props` (the
model's context, slots, sampling defaults and chat template; no file paths), `POST /v1/rerank`.

Each takes `model` (the default model when absent); the model is loaded as for any request.
`/infill` is refused in one line for a model without fill-in-the-middle tokens, `/v1/rerank` for
every model here: none of ours scores query-document pairs (llama.cpp's rank pooling).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from localllm import __version__
from localllm.errors import Unsupported
from localllm.server.http import LiveResponse, read_json, scrub
from localllm.server.openai_api import BadRequest, Body, Parsed, _messages, _tools, sse
from localllm.types import Request as EngineRequest
from localllm.types import Result

if TYPE_CHECKING:
    from localllm.server.app import Server


def _stop_type(result: Result) -> str:
    if result.finish_reason == "length":
        return "limit"
    return "word" if result.stop_sequence else "eos"


def completion_body(name: str, result: Result) -> dict[str, Any]:
    """A finished infill in llama.cpp's `/completion` shape."""
    t = result.timings
    n = result.usage.completion_tokens
    return {"content": result.text, "model": name, "stop": True, "stop_type": _stop_type(result),
            "stopping_word": result.stop_sequence or "", "tokens_predicted": n,
            "tokens_evaluated": result.usage.prompt_tokens, "tokens_cached": result.usage.cached_tokens,
            "truncated": False,
            "timings": {"prompt_n": result.usage.prompt_tokens, "prompt_ms": t.prompt_s * 1e3,
                        "predicted_n": n, "predicted_ms": t.decode_s * 1e3,
                        "predicted_per_second": t.tokens_per_s(n)}}  # fmt: skip


def _infill(data: Any) -> Parsed:
    b = Body(data)
    prefix, suffix = b.text("input_prefix") or "", b.text("input_suffix") or ""
    extra = b.get("input_extra") or []
    if not isinstance(extra, list):
        raise BadRequest("input_extra must be a list of {filename, text}", "input_extra")
    files = []
    for i, chunk in enumerate(extra):
        c = Body(chunk, f"input_extra[{i}]")
        if c.text("text") is None:
            raise BadRequest(f"input_extra[{i}] needs its text", f"input_extra[{i}].text")
        files.append((c.text("filename") or "", c.text("text")))
    n = b.number("n_predict", -1, 2**31, integer=True)
    if n is None:
        n = b.number("max_tokens", 0, 2**31, integer=True)
    sampling = {"temperature": b.number("temperature", 0, 2), "top_p": b.number("top_p", 1e-9, 1),
                "top_k": b.number("top_k", 0, 1 << 20, integer=True), "min_p": b.number("min_p", 0, 1),
                "seed": b.number("seed", -(2**63), 2**64 - 1, integer=True), "stop": b.stop(),
                "max_tokens": None if n is None or n < 0 else n,
                "repeat_penalty": b.number("repeat_penalty", 0.01, 10)}  # fmt: skip
    p = Parsed(model=b.text("model"), stream=b.flag("stream"), include_usage=False, sampling=sampling,
               prompt=b.text("prompt") or "")  # fmt: skip
    p.fim, p.fim_files = (prefix, suffix), tuple(files)
    return p


def add_routes(app: FastAPI, server: Server) -> None:
    served = server.served

    async def with_model(name: str | None, fn: Any) -> Any:
        lease = await served.lease(name, served.options())
        try:
            return await asyncio.to_thread(fn, lease.model), lease.name
        finally:
            lease.close()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        b = Body(await read_json(request))
        content = b.text("content")
        if content is None:
            raise BadRequest("content must be a string", "content")
        add_special, pieces = b.flag("add_special"), b.flag("with_pieces")

        def run(model: Any) -> list[Any]:
            ids = model.tokenize(content, add_special=add_special)
            if not pieces:
                return ids
            out = []
            for t in ids:
                raw = model.backend.token_bytes(t)
                try:
                    piece: Any = raw.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(raw)  # as llama.cpp: a piece that is not whole UTF-8 goes as bytes
                out.append({"id": t, "piece": piece})
            return out

        ids, _ = await with_model(b.text("model"), run)
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        b = Body(await read_json(request))
        tokens = b.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise BadRequest("tokens must be a list of token ids", "tokens")

        def run(model: Any) -> str:
            n = int(model.backend.n_vocab)
            bad = [t for t in tokens if not 0 <= t < n]
            if bad:
                raise BadRequest(f"tokens: {bad[0]} is not a token of this model (0..{n - 1})", "tokens")
            return model.detokenize(tokens)

        content, _ = await with_model(b.text("model"), run)
        return {"content": content}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        b = Body(await read_json(request))
        messages = _messages(b.get("messages"))
        tools, _ = _tools(b)
        req = EngineRequest(messages=tuple(messages), tools=tuple(tools))
        prompt, _ = await with_model(b.text("model"), lambda m: m.render(req))
        return {"prompt": prompt}

    @app.get("/props")
    async def props(request: Request) -> dict[str, Any]:
        def run(model: Any) -> dict[str, Any]:
            s = model.sampling()
            template = model.backend.chat_template
            return {"default_generation_settings": {
                        "n_ctx": model.n_ctx,
                        "params": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                                   "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                                   "repeat_last_n": s.repeat_last_n, "n_predict": s.max_tokens or -1}},
                    "total_slots": model.options.parallel, "chat_template": template.source,
                    "bos_token": template.bos_token, "eos_token": template.eos_token,
                    "modalities": {"vision": "image" in model.backend.media, "audio": False},
                    "infill": bool(model.fim_tokens()), "build_info": f"localllm {__version__}"}  # fmt: skip

        body, name = await with_model(request.query_params.get("model"), run)
        return {"model_alias": name, **body}

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        parsed = _infill(await read_json(request))
        started = await server.start(parsed)
        name = started.lease.name
        if not parsed.stream:
            result = await server.to_end(started, request, "/infill")
            return result if isinstance(result, Response) else JSONResponse(completion_body(name, result))

        def piece(chunk: Any) -> bytes:
            return sse({"content": chunk.text, "stop": False}) if chunk.text else b""

        def failed(message: str) -> bytes:
            return sse({"error": {"code": 500, "message": scrub(message), "type": "server_error"}})

        body = server.events(started, "/infill", b"", piece, lambda r: sse(completion_body(name, r) | {"content": ""}),
                             failed, b"")  # fmt: skip
        return LiveResponse(body, "text/event-stream", {"Cache-Control": "no-cache"})

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(request: Request) -> Response:
        Body(await read_json(request))
        raise Unsupported("no reranker is served here: /v1/rerank needs a model that scores query-document "
                          "pairs (llama.cpp's rank pooling), and localllm runs none yet")  # fmt: skip
