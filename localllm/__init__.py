"""localllm: run language models on your own machine.

import localllm
llm = localllm.load("smollm2")
print(llm.chat([{"role": "user", "content": "hi"}], max_tokens=32, temperature=0).text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from localllm.engine import Model


def load(model: str, **options: Any) -> Model:
    """Load a model by name; see `localllm.engine.load` for the options."""
    from localllm.engine import load as _load

    return _load(model, **options)
