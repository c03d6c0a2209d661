"""Names are checked before anything is built from them."""

from __future__ import annotations

import pytest

from localllm.errors import InvalidName
from localllm.models_registry.names import ModelName, check_digest, parse_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("smollm2", ModelName("smollm2")),
        ("smollm2:135m-instruct-q4_1", ModelName("smollm2", "135m-instruct-q4_1")),
        ("qwen2.5:0.5b", ModelName("qwen2.5", "0.5b")),
        ("library/foo:latest", ModelName("library/foo", "latest")),
        (
            "hf.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M",
            ModelName("hf.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M"),
        ),
        ("hf.co/org/repo/model-q8_0.gguf", ModelName("hf.co/org/repo/model-q8_0.gguf")),
    ],
)
def test_valid_names(text: str, expected: ModelName) -> None:
    assert parse_name(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "../x", "a/../b", "..", "./a", "/abs/path", "~/x", "C:\\x", "a\\b", "a//b",
        "x:", "x:../y", "x:a/b", "na me", "tab\tname", "new\nline", "nul\0", "émoji", "a/b/c",
        "hf.co/org", "hf.co/org/repo/file.bin", "hf.co/../repo", "-leading", "x" * 400,
        "http://evil/x", "name:tag:extra/..",
    ],
)  # fmt: skip
def test_invalid_names(text: str) -> None:
    with pytest.raises(InvalidName):
        parse_name(text)


def test_digests() -> None:
    d = "a" * 64
    assert check_digest(d) == d and check_digest("sha256:" + d) == d
    for bad in ("../" + "a" * 61, "A" * 64, "a" * 63, "sha256:" + "g" * 64, "a" * 64 + "/x"):
        with pytest.raises(InvalidName):
            check_digest(bad)
