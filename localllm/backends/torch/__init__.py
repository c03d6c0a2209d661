"""localllm's own runner: Llama / Qwen / Gemma transformers in PyTorch, on GGUF weights.

    tokenizer.py   the GGUF vocabulary as a Hugging Face `tokenizers` tokenizer (no llama.cpp)
    weights.py     GGUF tensors → torch tensors (vectorized dequantization, memory-mapped)
    cache.py       per-layer KV caches with one interface (update_and_fetch, offset, trim, ...)
    models/        one readable file per architecture family; stateless `Model`s
    quantized.py   fp16-weight linear layers (fbgemm, f32 sums): the CPU's fast path
    policies.py    caches that forget (StreamingLLM, H2O); kvquant.py: quantized KV types
    runner.py      the forward pass over slots the engine drives (`TorchRunner`), and `open_runner`

Importing this package imports nothing heavy: torch is imported by the modules above.
"""
