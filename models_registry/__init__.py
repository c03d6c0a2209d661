"""Models on disk (installed as `localllm.models_registry`): names, catalog, store, pull, scan."""
