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
    from localllm.types import LoadOptions


def load(model: str, options: LoadOptions | None = None, **kw: Any) -> Model:
    """Load a model by name with `LoadOptions` (or its fields as keywords: `ctx=2048,
    kv_cache="q8_0", streaming=(4, 1020)`); see `localllm.engine.load`."""
    from localllm.engine import load as _load

    return _load(model, options, **kw)
