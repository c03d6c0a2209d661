"""Errors a user can meet. Each front door turns them into one plain line (and exit code 1)."""

from __future__ import annotations

import os


class LocalLLMError(Exception):
    """Base class: the message is the whole story, shown to the user as one line."""


class GGUFFormatError(LocalLLMError):
    """A file is not a GGUF we can trust: names the file and the reason."""

    what = "not a valid GGUF file"

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{os.path.basename(self.path)}: {self.what}: {reason}")


class InconsistentModel(GGUFFormatError):
    """A well-formed GGUF whose hyperparameters disagree with its tensors (llama.cpp may abort)."""

    what = "inconsistent model file"


class InvalidName(LocalLLMError):
    """A model name that could become a path or is otherwise malformed."""


class ModelNotFound(LocalLLMError):
    """No local model and no catalog entry for a name."""


class StoreError(LocalLLMError):
    """The store cannot do what was asked (disk full, locked, inconsistent input)."""


class DoesNotFit(LocalLLMError):
    """A model with its context does not fit in the memory available."""


class TemplateError(LocalLLMError):
    """A chat template failed, escaped its sandbox, ran too long or produced too much."""


class ContextOverflow(LocalLLMError):
    """Prompt and generation do not fit the context and no shifting policy was chosen."""


class OutOfBlocks(LocalLLMError):
    """The KV pool has no free block for a forward pass (it changed nothing): the engine makes
    room — drops unused prefix-cache entries, or puts a request back to wait for a slot's blocks."""


class BackendUnavailable(LocalLLMError):
    """A backend cannot run on this machine (not installed, or its probe crashed): reason and fix."""


class Unsupported(LocalLLMError):
    """A request field or load option the chosen backend cannot honour (refused, never ignored)."""


class Cancelled(LocalLLMError):
    """The user stopped a long job (a benchmark, a comparison) before it ended."""
