"""The local HTTP server: OpenAI's and Ollama's routes over the engine (FastAPI + uvicorn).

Optional: `pip install 'localllm[server]'`. Nothing below the front doors imports it.
"""

from __future__ import annotations

from localllm.server.config import DEFAULT_HOST, DEFAULT_PORT, ServerConfig

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ServerConfig"]
