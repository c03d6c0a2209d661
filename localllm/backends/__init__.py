"""Inference backends. Each declares its capabilities; `localllm.engine` drives them."""
