"""Ollama's routes, so Ollama clients work against localllm: tags, show, ps, version, chat,
generate (NDJSON streaming, on by default as in Ollama), embed and the legacy embeddings, `GET /`.
Same engine, same admission, same metrics as the OpenAI routes; only the shapes differ. Durations
are nanoseconds, as Ollama's; errors are `{"error": "text"}`. A documented field this server
does not honour is a 400 naming it (the README's parity table lists each one); `keep_alive` sets
how long the model stays loaded after the request (0 unloads it, negative keeps it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from localllm import __version__
from localllm.errors import LocalLLMError, ModelNotFound
from localllm.server.config import keep_alive_seconds
from localllm.server.http import LiveResponse, read_json, scrub
from localllm.server.openai_api import BadRequest, Body, Parsed, _messages, image_bytes
from localllm.types import Chunk, Result

if TYPE_CHECKING:
    from localllm.server.app import Server

_OPTIONS = {  # Ollama option → (SamplingParams field, lo, hi, integer)
    "temperature": ("temperature", 0, 100, False),
    "top_p": ("top_p", 1e-9, 1, False),
    "top_k": ("top_k", 0, 1 << 20, True),
    "min_p": ("min_p", 0, 1, False),
    "repeat_penalty": ("repeat_penalty", 0.01, 10, False),
    "repeat_last_n": ("repeat_last_n", 0, 1 << 20, True),
    "presence_penalty": ("presence_penalty", -2, 2, False),
    "frequency_penalty": ("frequency_penalty", -2, 2, False),
    "seed": ("seed", -(2**63), 2**64 - 1, True),
}
# Ollama's documented options this server does not honour: refused, never silently ignored
_REFUSED_OPTIONS = ("num_keep", "typical_p", "penalize_newline", "numa", "num_batch",
                    "main_gpu", "use_mmap", "num_thread", "mirostat", "mirostat_tau",
                    "mirostat_eta", "tfs_z", "low_vram", "vocab_only", "use_mlock")  # fmt: skip
_KNOWN_OPTIONS = {*_OPTIONS, "num_predict", "stop", "num_ctx", "num_gpu"}
FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model kept loaded until stopped


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _parse(data: Any) -> tuple[Parsed, Body]:
    b = Body(data)
    model = b.text("model")
    if not model:
        raise BadRequest("model is required", "model")
    stream = b.flag("stream", True)
    sampling: dict[str, Any] = {}
    opts = b.obj("options")
    ctx = gpu_layers = None
    if opts is not None:
        for key in opts.data:
            if key not in _KNOWN_OPTIONS:
                why = "not supported" if key in _REFUSED_OPTIONS else "not an option this server knows"
                raise BadRequest(f"options.{key} is {why}", f"options.{key}")
        for key, (name, lo, hi, integer) in _OPTIONS.items():
            v = opts.number(key, lo, hi, integer=integer)
            if v is not None:
                sampling[name] = v
        n = opts.number("num_predict", -2, 2**31, integer=True)
        if n is not None and n >= 0:
            sampling["max_tokens"] = n
        stop = opts.stop()
        if stop:
            sampling["stop"] = stop
        ctx = opts.number("num_ctx", 16, 1 << 24, integer=True)
        layers = opts.number("num_gpu", -1, 1 << 16, integer=True)  # layers on the GPU; -1: auto
        if layers is not None:
            gpu_layers = "auto" if layers < 0 else str(layers)
    fmt = b.get("format")
    response_format = None
    if fmt == "json":
        response_format = {"type": "json_object"}
    elif isinstance(fmt, dict):
        response_format = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise BadRequest('format must be "json" or a JSON schema object', "format")
    keep_alive = _keep_alive(b)
    think = b.get("think")
    if think is not None and not (isinstance(think, bool) or think in ("low", "medium", "high")):
        raise BadRequest('think must be true, false, "low", "medium" or "high"', "think")
    p = Parsed(model=model, stream=stream, include_usage=False, sampling=sampling,
               response_format=response_format, ctx=ctx, gpu_layers=gpu_layers, think=think,
               keep_alive=keep_alive)  # fmt: skip
    return p, b


def _details(info: Any) -> dict[str, Any]:
    from localllm.model_info import human_params

    return {"parent_model": "", "format": "gguf", "family": info.architecture,
            "families": [info.architecture], "parameter_size": human_params(info.parameters),
            "quantization_level": info.quant}  # fmt: skip


def _tag(record: Any) -> dict[str, Any]:
    return {"name": record.name, "model": record.name,
            "modified_at": datetime.fromtimestamp(record.added, UTC).isoformat().replace("+00:00", "Z"),
            "size": record.size, "digest": record.digest, "details": _details(record.info)}  # fmt: skip


def _final(model: str, result: Result, extra: dict[str, Any]) -> dict[str, Any]:
    t, u = result.timings, result.usage
    reason = {"cancelled": "stop", "tool_calls": "stop", "error": "stop"}.get(result.finish_reason, result.finish_reason)
    return {"model": model, "created_at": _now(), **extra, "done": True, "done_reason": reason,
            "total_duration": _ns(t.total_s), "load_duration": _ns(t.load_s),
            "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": _ns(t.prompt_s),
            "eval_count": u.completion_tokens, "eval_duration": _ns(t.decode_s)}  # fmt: skip


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def add_routes(app: FastAPI, server: Server) -> None:
    served = server.served

    @app.get("/api/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    # Ollama's model-management routes this server does not take: refused by name, with the way
    # to do it here (a 404 would read as "no server")
    for method, path, instead in (
        ("POST", "/api/pull", "localllm pull MODEL"), ("POST", "/api/push", "localllm import to add models (it pushes none)"),
        ("POST", "/api/create", "localllm import FILE.gguf or localllm quantize"),
        ("POST", "/api/copy", "localllm import"), ("DELETE", "/api/delete", "localllm rm MODEL"),
        ("POST", "/api/blobs/{digest}", "localllm import FILE.gguf"),
        ("HEAD", "/api/blobs/{digest}", "localllm import FILE.gguf"),
    ):  # fmt: skip
        app.add_api_route(path, _refuse(path.split("/")[2], instead), methods=[method])

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [_tag(r) for r in served.store.list()]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        b = Body(await read_json(request))
        name = b.text("model") or b.text("name")
        if not name:
            raise BadRequest("model is required", "model")
        record = served.record(name)
        info = record.info
        template = ""
        from localllm.gguf_file import GGUFFile

        try:
            with GGUFFile(served.store.path_of(record)) as gf:
                template = gf.get("tokenizer.chat_template") or ""
        except Exception:  # noqa: BLE001 - shown as no template
            template = ""
        arch = info.architecture
        return {"license": info.license, "modelfile": "", "parameters": "", "template": template,
                "details": _details(info),
                "model_info": {"general.architecture": arch, "general.parameter_count": info.parameters,
                               f"{arch}.context_length": info.context_length,
                               f"{arch}.block_count": info.n_layers, f"{arch}.embedding_length": info.n_embd},
                "capabilities": ["completion", "embedding"] + (["tools"] if template and "tools" in template else []),
                "modified_at": _tag(record)["modified_at"]}  # fmt: skip

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        from localllm.models_registry.catalog import find_local

        out = []
        store = served.store
        held = {e.name: e for e in served.pool.loaded()}
        expiry = served.expires()
        for name, model in served.loaded():
            record = find_local(name, store)
            entry = held.get(name)
            until = expiry.get(name, math.inf)
            expires = (FOREVER if not math.isfinite(until)
                       else datetime.fromtimestamp(until, UTC).isoformat().replace("+00:00", "Z"))  # fmt: skip
            opts = model.options
            out.append({"name": name, "model": name, "size": entry.held_bytes if entry else 0,
                        "digest": record.digest if record else "",
                        "details": _details(record.info) if record else {},
                        "expires_at": expires,
                        "size_vram": 0,
                        "localllm": {"backend": model.backend.name, "ctx": model.n_ctx,
                                     "kv_cache": opts.kv_cache, "parallel": model.parallel,
                                     "running": model.running, "waiting": model.waiting,
                                     "kv_bytes": model.kv_bytes(), "speculative": opts.speculative or "off",
                                     "options": asdict(opts)}})  # fmt: skip
        return {"models": out}

    async def run(request: Request, parsed: Parsed, route: str, shape: Any, tools: bool) -> Response:
        started = await server.start(parsed)
        name = started.lease.name
        if not parsed.stream:
            result = await server.to_end(started, request, route)
            if isinstance(result, Response):
                return result
            return JSONResponse(_final(name, result, shape(result.text, result.reasoning, result)))
        held = [] if tools else None  # with tools: the answer comes at the end (a call or text)

        def piece(chunk: Chunk) -> bytes:
            text = chunk.text
            if held is not None:
                held.append(text)
                text = ""
            if not (text or chunk.reasoning):
                return b""
            return _line({"model": name, "created_at": _now(), **shape(text, chunk.reasoning, None),
                          "done": False})  # fmt: skip

        def last(result: Result) -> bytes:
            return _line(_final(name, result, shape(result.text if held is not None else "", "", result)))

        def failed(message: str) -> bytes:
            return _line({"error": scrub(message)})

        body = server.events(started, route, b"", piece, last, failed, b"")
        return LiveResponse(body, "application/x-ndjson")

    async def load_or_unload(parsed: Parsed) -> Response:
        """A request with nothing to say loads the model (`keep_alive: 0`: unloads it)."""
        if parsed.keep_alive == 0:
            name, reason = parsed.model or served.default, "unload"
            if not served.stop(name):
                raise ModelNotFound(f"{name} is not loaded, so there is nothing to stop")
        else:
            lease = await served.lease(parsed.model, served.options(ctx=parsed.ctx,
                                                                    gpu_layers=parsed.gpu_layers))
            lease.close(parsed.keep_alive)
            name, reason = lease.name, "load"
        return JSONResponse({"model": name, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                             "response": "", "done": True, "done_reason": reason})  # fmt: skip

    @app.get("/")
    async def root() -> Response:
        return Response("Ollama is running", media_type="text/plain")

    @app.head("/")
    async def root_head() -> Response:
        return Response(media_type="text/plain")

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        parsed, b = _parse(await read_json(request))
        if b.get("messages") in (None, []):
            return await load_or_unload(parsed)
        parsed.messages = _messages(b.get("messages"))
        for i, m in enumerate(b.get("messages") or []):
            if isinstance(m, dict) and m.get("images") is not None:
                parsed.messages[i]["images"] = _images(m.get("images"), f"messages[{i}].images")
        tools = b.get("tools") or []
        if not isinstance(tools, list):
            raise BadRequest("tools must be a list", "tools")
        parsed.tools = tools

        def shape(text: str, thinking: str | None, result: Result | None) -> dict[str, Any]:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if result is not None and result.tool_calls:
                message["tool_calls"] = [{"function": {"name": t.name, "arguments": _args(t.arguments)}}
                                         for t in result.tool_calls]  # fmt: skip
            return {"message": message}

        return await run(request, parsed, "/api/chat", shape, bool(tools))

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        parsed, b = _parse(await read_json(request))
        prompt = b.text("prompt") or ""
        system = b.text("system")
        raw = b.flag("raw")
        images = _images(b.get("images"), "images") if b.get("images") is not None else []
        for name in ("suffix", "template", "context"):  # documented, not honoured here
            if b.get(name):
                raise BadRequest(f"{name} is not supported", name)
        if not prompt:  # Ollama: an empty prompt loads the model and answers done
            return await load_or_unload(parsed)
        if raw:
            parsed.prompt, parsed.images = prompt, images
        else:
            parsed.messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt} | ({"images": images} if images else {})]

        def shape(text: str, thinking: str | None, _result: Result | None) -> dict[str, Any]:
            return {"response": text, **({"thinking": thinking} if thinking else {})}

        return await run(request, parsed, "/api/generate", shape, False)

    @app.post("/api/embed")
    async def embed(request: Request) -> dict[str, Any]:
        import asyncio

        b = Body(await read_json(request))
        inputs = b.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) and t for t in inputs):
            raise BadRequest("input must be a string or a list of non-empty strings", "input")
        if b.get("dimensions") is not None:
            raise BadRequest("dimensions is not supported: the model's own size is returned", "dimensions")
        if b.get("options"):
            raise BadRequest("options are not supported on /api/embed", "options")
        if b.get("truncate") is True:
            raise BadRequest("truncate is not supported: an input longer than the context is refused",
                             "truncate")  # fmt: skip
        keep = _keep_alive(b)
        lease = await served.lease(b.text("model"), served.options())
        try:
            vectors = await asyncio.to_thread(lease.model.embed, inputs)
        finally:
            lease.close(keep)
        return {"model": lease.name, "embeddings": vectors}

    @app.post("/api/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        """The legacy route: one `prompt`, one `embedding`."""
        import asyncio

        b = Body(await read_json(request))
        prompt = b.text("prompt")
        if not prompt:
            raise BadRequest("prompt must be a non-empty string", "prompt")
        if b.get("options"):
            raise BadRequest("options are not supported on /api/embeddings", "options")
        keep = _keep_alive(b)
        lease = await served.lease(b.text("model"), served.options())
        try:
            (vector,) = await asyncio.to_thread(lease.model.embed, [prompt])
        finally:
            lease.close(keep)
        return {"embedding": vector}


def _refuse(name: str, instead: str) -> Any:
    async def refused() -> Response:  # (error messages lose paths: the route goes by its name)
        raise BadRequest(f"Ollama's {name} route is not supported by this server; use {instead}", name)

    return refused


def _images(raw: Any, where: str) -> list[bytes]:
    """Ollama's `images`: a list of base64-encoded image files."""
    if not isinstance(raw, list):
        raise BadRequest(f"{where} must be a list of base64 images", where)
    return [image_bytes(x, f"{where}[{j}]") for j, x in enumerate(raw)]


def _keep_alive(b: Body) -> float | None:
    if b.get("keep_alive") is None:
        return None
    try:
        return keep_alive_seconds(b.get("keep_alive"))
    except LocalLLMError as e:
        raise BadRequest(str(e), "keep_alive") from None


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
