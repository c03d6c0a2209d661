"""Quantization (installed as `localllm.quant`): block formats, legacy and k-quants, mixes, reports."""
