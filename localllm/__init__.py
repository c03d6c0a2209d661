"""localllm: run language models on your own machine."""

from __future__ import annotations

__version__ = "0.1.0"
