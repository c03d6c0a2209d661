"""Qwen2 / Qwen2.5: the Llama block with biases on q, k and v, and half-split RoPE as stored.

The biases need no code of their own: the loader fuses `attn_{q,k,v}.bias` into the qkv
projection whenever the file has them. Unlike llama.cpp's `llama`, the `qwen2` converter leaves
q/k rows as Hugging Face has them (llama.cpp runs NEOX RoPE for this architecture).
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.backends.torch.models import llama
from localllm.backends.torch.models.base import BaseModelArgs


@dataclass
class ModelArgs(BaseModelArgs):
    """Only the shared hyperparameters (`BaseModelArgs`)."""


class Model(llama.Model):
    permuted_qk = False
