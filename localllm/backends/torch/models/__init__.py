"""One readable file per architecture family; each has `ModelArgs` and a stateless `Model`:

model = build_model(gguf_file)                  # weights streamed from the GGUF
caches = [model.make_caches(n_ctx)]             # one list of per-layer caches per row
h = model(tokens (B, T), caches)                # (B, T, dim), after the final norm
logits = model.logits(h[:, -1])                 # (B, vocab) float32
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
from torch import nn

from localllm.backends.torch.models import gemma3, llama, qwen2, qwen3
from localllm.backends.torch.models.base import LinearFactory, load_weights
from localllm.errors import InconsistentModel, LocalLLMError
from localllm.gguf_file import GGUFFile

__all__ = ["ARCHITECTURES", "build_model"]

# GGUF `general.architecture` → the module that runs it
ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
}


def build_model(f: GGUFFile, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", linear: LinearFactory | None = None) -> nn.Module:  # fmt: skip
    """The model of `f`, built on the meta device and filled as tensors stream from the map.

    Args:
        dtype: working dtype of the weights (1-D norms stay float32).
        linear: `linear(weight (out, in), bias | None) -> nn.Module` builds each projection as
            soon as its weights are in (e.g. an int8 linear), the output head included.
    Raises:
        LocalLLMError: the architecture is not one of ARCHITECTURES.
        InconsistentModel: hyperparameters or tensors do not make a model of that architecture.
    """
    arch = f.architecture
    module = ARCHITECTURES.get(arch)
    if module is None:
        raise LocalLLMError(
            f"{os.path.basename(f.path)}: the torch engine cannot run architecture {arch!r} "
            f"(it runs {', '.join(ARCHITECTURES)})"
        )
    try:
        args = module.ModelArgs.from_gguf(f.metadata)
    except (ValueError, TypeError) as e:
        raise InconsistentModel(f.path, str(e)) from None
    with torch.device("meta"):
        model = module.Model(args)
    try:
        load_weights(model, f, dtype=dtype, device=device, linear=linear,
                     convert=getattr(model, "convert", None))  # fmt: skip
    except ValueError as e:  # a model's load hook refusing a tensor
        raise InconsistentModel(f.path, str(e)) from None
    return model.eval()
