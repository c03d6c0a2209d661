"""Names are checked before anything is built from them."""

from __future__ import annotations

import pytest

from localllm.errors import InvalidName
from localllm.models_registry.names import (
    SPLIT_GGUF,
    ModelName,
    check_digest,
    name_from_file,
    parse_name,
    slug,
    split_gguf_name,
)


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


@pytest.mark.parametrize(
    ("filename", "parts"),
    [
        ("Qwen2.5-7B-Q4_K_M-00001-of-00003.gguf", ("Qwen2.5-7B-Q4_K_M", "00001", "00003")),
        ("a-b-00002-of-00002.gguf", ("a-b", "00002", "00002")),
        ("dir/x-00010-of-00012.gguf", ("dir/x", "00010", "00012")),
        ("LMStudio-00001-of-00002.GGUF", ("LMStudio", "00001", "00002")),  # other tools' folders
        ("model-q4_k_m.gguf", None),
        ("x-0001-of-00002.gguf", None),  # llama.cpp writes five digits
        ("x-00001-of-00002.gguf.part", None),
        ("x-00001-OF-00002.gguf", None),  # llama.cpp writes `-of-`
        ("x-\u0661\u0662\u0663\u0664\u0665-of-00002.gguf", None),  # ASCII digits only
        ("-00001-of-00002.gguf", None),  # no stem
    ],
)
def test_split_gguf_names(filename: str, parts: tuple[str, str, str] | None) -> None:
    m = SPLIT_GGUF.fullmatch(filename)
    assert (m["stem"], m["part"], m["total"]) == parts if m else parts is None


def test_split_gguf_name_round_trips() -> None:
    name = split_gguf_name("org/model-Q8_0", 2, 12)
    assert name == "org/model-Q8_0-00002-of-00012.gguf"
    m = SPLIT_GGUF.fullmatch(name)
    assert m and (m["stem"], int(m["part"]), int(m["total"])) == ("org/model-Q8_0", 2, 12)


def test_slugs_are_valid_names() -> None:
    assert slug("Meta Llama 3.1 (8B) Instruct!", 96) == "meta-llama-3.1-8b-instruct"
    assert slug("__..--", 96) == ""
    assert slug("abc-def", 4) == "abc"  # no separator left at the cut
    assert name_from_file("/x/My Model Q4_K_M.gguf") == "my-model-q4_k_m"
    assert name_from_file("/x/....gguf") == "model"
    long = name_from_file("/x/" + "a" * 95 + "-b" * 10 + ".gguf")
    assert len(long) <= 96 and not long.endswith("-")
    parse_name(long)
