"""The engine owns decoding; a backend is a `Runner` (`localllm.backends.base`).

core        Model (one scheduler thread per loaded model), Stream, load()
scheduler   what each step evaluates: decoding sequences, drafts, a bounded prompt chunk
slots       which slot a prompt takes and what of its cache it reuses
sampling    the sampler (penalties, top-k, top-p, min-p, temperature, seeds; logprobs)
speculative drafters (prompt lookup, draft model, layer skip), the accept rule, the pace
scoring     perplexity and KL through `forward` (eval, recommend, the quantize report)
tune        the layer-skip drafter's skip set, searched once per model and device
output      tokens → text, chunks and the Result
"""

from localllm.backends import check_options
from localllm.engine.core import (
    Model,
    Stream,
    check_context,
    check_supported,
    choose_backend,
    load,
    prompt_ids,
    sampling_defaults,
)
from localllm.engine.output import Assembler, Step, StopMatcher
from localllm.engine.scheduler import Scheduler

__all__ = [
    "Assembler",
    "Model",
    "Scheduler",
    "Step",
    "StopMatcher",
    "Stream",
    "check_context",
    "check_options",
    "check_supported",
    "choose_backend",
    "load",
    "prompt_ids",
    "sampling_defaults",
]
