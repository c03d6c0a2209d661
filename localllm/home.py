"""Where localllm keeps its files: the store of models, logs, tuned results, probe verdicts.

One rule for every layer (the registry's store, the runners' logs and first-run checks): a runner
must not import the model registry to find the folder."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """`$LOCALLLM_HOME`, else the platform's user data folder for localllm."""
    env = os.environ.get("LOCALLLM_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("localllm", appauthor=False))
