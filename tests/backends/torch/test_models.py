"""The torch models against Hugging Face transformers' reference implementations.

Tiny random models of each family are made in transformers, converted to F32 GGUF the way
llama.cpp's converter does it (its tensor names from `gguf`, the q/k row permutation for Llama,
Gemma's norm + 1, Llama 3's RoPE scaling as `rope_freqs.weight`), then loaded by transformers'
GGUF loader (the oracle) and by ours. Logits must agree in float32 however the tokens are fed:
all at once, one by one through the cache, in chunks, and two rows at different offsets.
The real default model (and, with -m slow, Gemma 3 270M) must decode greedily exactly as
transformers does. Transformers needs `accelerate` to load GGUF files.
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.errors import InconsistentModel, LocalLLMError
from localllm.gguf_file import GGUFFile

from conftest import need

N_TOKENS = 64
VOCAB = 384
TOL = 1e-4

# family → (transformers config class, its settings beyond the common ones in `hf_model`)
TINY = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "llama3-rope": ("LlamaConfig", {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", {"rope_theta": 1000000.0, "head_dim": 32}),
    "gemma3": ("Gemma3TextConfig", {"rope_theta": 1000000.0, "head_dim": 32, "sliding_window": 16,
                                    "query_pre_attn_scalar": 32, "num_hidden_layers": 7}),
}  # fmt: skip
ARCH = {"LlamaConfig": "llama", "Qwen2Config": "qwen2", "Qwen3Config": "qwen3",
        "Gemma3TextConfig": "gemma3"}  # fmt: skip


def hf_model(family: str, **overrides):
    """A tiny random transformers model: GQA, weights scaled so activations and logits are O(1)
    (the default 0.02 init would make every logit nearly 0 and any comparison pass).
    `overrides`: config settings over the family's (e.g. num_hidden_layers)."""
    import transformers

    cls_name, extra = TINY[family]
    kwargs = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": family in ("qwen2", "gemma3"),
    }  # fmt: skip
    kwargs.update(extra)
    kwargs.update(overrides)
    if "rope_scaling" in kwargs:  # transformers 5 spells it rope_parameters
        kwargs["rope_parameters"] = {
            **kwargs.pop("rope_scaling"),
            "rope_theta": kwargs["rope_theta"],
        }
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(list(TINY).index(family))
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms are 1 + w: center them on 0 there
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if family == "gemma3" else 1.0))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: half-split → adjacent-pair rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(cfg) -> np.ndarray:
    """llama.cpp's converter: Llama 3 RoPE scaling as per-frequency divisors (`rope_freqs`)."""
    rp = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model, path: Path) -> Path:
    """Write `model` as llama.cpp's convert_hf_to_gguf.py would, in F32."""
    import gguf

    cfg = model.config
    arch = ARCH[type(cfg).__name__]
    gguf_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                 "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch]  # fmt: skip
    names = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    else:  # vocabulary size from the token list, as transformers and llama.cpp read it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    # the minimal tokenizer section a GGUF loader expects
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = permute(data, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # Gemma3Model.modify_tensors: norm_shift
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    if arch == "llama" and cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@contextlib.contextmanager
def transformers_gguf_loader():
    """transformers' GGUF loader, with `gguf.get_tensor_name_map` memoized: the loader rebuilds
    the same (architecture, layers) name map once per submodule (~400 times for SmolLM2, most
    of its load time). The function is pure; memoizing changes no result."""
    need("transformers", "pip install -e '.[dev]'")
    need("accelerate", "pip install accelerate (transformers needs it to load GGUF files)")
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


def hf_from_gguf(path: Path, reference):
    """transformers' own GGUF loader on our file. Some settings its GGUF config mapping does not
    read come from the reference config: Llama 3's rope_parameters (a `rope_freqs` tensor in
    GGUF), Qwen3's head_dim (`attention.key_length`, which it reads for Gemma 3 only), and Gemma's
    query_pre_attn_scalar (not in GGUF; the head size here, which is what llama.cpp uses)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with transformers_gguf_loader():
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        config.rope_parameters = reference.config.rope_parameters
        for key in ("head_dim", "query_pre_attn_scalar"):
            if getattr(reference.config, key, None) is not None:
                setattr(config, key, getattr(reference.config, key))
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=config, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    """(our model, transformers' logits (2, 64, V) for `tokens`, tokens (2, 64), GGUF path)."""
    need("transformers", "pip install -e '.[dev]'")
    need("gguf", "pip install -e '.[dev]'")
    from localllm.backends.torch.models import build_model

    reference = hf_model(request.param)
    path = write_gguf(reference, tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf")
    oracle = hf_from_gguf(path, reference)
    tokens = torch.randint(0, VOCAB, (2, N_TOKENS), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = oracle(tokens).logits.float()
        # our GGUF writer is a faithful converter: transformers gets its own model back
        assert (reference(tokens).logits - want).abs().max() <= TOL
    with GGUFFile(path) as f:
        ours = build_model(f)
    return ours, want, tokens, path


def run(model, tokens: torch.Tensor, caches) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(tokens, caches))


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert want.std() > 0.3  # the logits are not all near zero (a vacuous comparison)
    assert (got - want).abs().max().item() <= TOL


def test_whole_prompt(tiny):
    model, want, tokens, _ = tiny
    check(run(model, tokens[:1], [model.make_caches(N_TOKENS)]), want[:1])


def test_token_by_token(tiny):
    model, want, tokens, _ = tiny
    caches = [model.make_caches(N_TOKENS)]
    got = torch.cat([run(model, tokens[:1, i : i + 1], caches) for i in range(N_TOKENS)], dim=1)
    check(got, want[:1])
    assert caches[0][0].offset == N_TOKENS


def test_chunked_prefill(tiny):
    model, want, tokens, _ = tiny
    caches = [model.make_caches(N_TOKENS)]
    got = torch.cat([run(model, tokens[1:, :16], caches), run(model, tokens[1:, 16:], caches)], 1)
    check(got, want[1:])


def test_two_rows_at_different_offsets(tiny):
    """Row 0 has 20 tokens cached and row 1 has 40; then 20 more each in one (2, 20) forward,
    then 4 decode steps of (2, 1)."""
    model, want, tokens, _ = tiny
    rows = [model.make_caches(N_TOKENS), model.make_caches(N_TOKENS)]
    run(model, tokens[:1, :20], rows[:1])
    run(model, tokens[1:, :40], rows[1:])
    both = run(model, torch.stack([tokens[0, 20:40], tokens[1, 40:60]]), rows)
    check(both[0], want[0, 20:40])
    check(both[1], want[1, 40:60])
    for i in range(4):
        step = run(
            model, torch.stack([tokens[0, 40 + i : 41 + i], tokens[1, 60 + i : 61 + i]]), rows
        )
        check(step[:, 0], torch.stack([want[0, 40 + i], want[1, 60 + i]]))


def test_half_precision_cache_and_bfloat16_weights(tiny):
    """A float16 cache under float32 compute (keys are converted back for attention), and
    bfloat16 weights: within their rounding (float16 keeps ~11 bits, bfloat16 8)."""
    from localllm.backends.torch.models import build_model

    model, want, tokens, path = tiny
    bound = want[:1].abs().max().item()
    caches = [model.make_caches(N_TOKENS, dtype=torch.float16)]
    got = torch.cat([run(model, tokens[:1, i : i + 1], caches) for i in range(N_TOKENS)], dim=1)
    assert (got - want[:1]).abs().max().item() <= 1e-3 * bound
    with GGUFFile(path) as f:
        bf16 = build_model(f, dtype=torch.bfloat16)
    assert bf16.make_caches(1)[0].dtype == torch.bfloat16
    got = run(bf16, tokens[:1], [bf16.make_caches(N_TOKENS)])
    assert got.dtype == torch.float32
    assert (got - want[:1]).abs().max().item() <= 2.5e-2 * bound


def test_float32_layouts(tiny):
    """Wide float32 matrices are column-major (MKL's faster layout for one row), the others as
    stored; a tied head shares the embedding's memory (no second copy)."""
    model, _, _, path = tiny
    for layer in model.layers:
        for lin in (layer.attention.wqkv, layer.feed_forward.w13, layer.feed_forward.w2):
            w = lin.weight
            out, inp = w.shape
            assert w.stride() == ((1, out) if out > inp else (inp, 1)), (out, inp, w.stride())
    with GGUFFile(path) as f:
        tied = "output.weight" not in f.tensors
    if tied:
        assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()


def test_linear_factory_builds_every_projection(tiny):
    """`linear=` receives each fused projection once, the head too (also when it is tied to
    the embedding), and what it returns is what runs."""
    from localllm.backends.torch.models import build_model
    from localllm.backends.torch.models.base import default_linear

    _, want, tokens, path = tiny
    built = []

    def linear(weight, bias):
        built.append(tuple(weight.shape))
        return default_linear(weight * 0 + weight, bias)  # a copy: the head is not shared

    with GGUFFile(path) as f:
        model = build_model(f, linear=linear)
    a = model.args
    qkv = ((a.n_heads + 2 * a.n_kv_heads) * a.head_dim, a.dim)
    layer = [qkv, (a.dim, a.n_heads * a.head_dim), (2 * a.ffn_dim, a.dim), (a.dim, a.ffn_dim)]
    assert sorted(built) == sorted(layer * a.n_layers + [(a.vocab_size, a.dim)])
    check(run(model, tokens[:1], [model.make_caches(N_TOKENS)]), want[:1])


def write_broken(tmp_path: Path, **config: int) -> Path:
    """A tiny Llama whose metadata disagrees with its tensors (`config` overrides the former)."""
    reference = hf_model("llama")
    for key, value in config.items():
        setattr(reference.config, key, value)
    return write_gguf(reference, tmp_path / "broken.gguf")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"intermediate_size": 100}, "tensor 'blk.0.ffn_gate.weight' has shape (128, 64), expected (100, 64)"),
        ({"num_hidden_layers": 3}, "missing tensor blk.2.attn_q.weight / blk.2.attn_k.weight"),
        ({"num_key_value_heads": 1}, "'blk.0.attn_k.weight' has shape (32, 64), expected (16, 64)"),
    ],
)  # fmt: skip
def test_inconsistent_model_is_one_line(tmp_path, config, message):
    from localllm.backends.torch.models import build_model

    path = write_broken(tmp_path, **config)
    with GGUFFile(path) as f, pytest.raises(InconsistentModel) as e:
        build_model(f)
    assert "\n" not in str(e.value) and "broken.gguf" in str(e.value) and message in str(e.value)


def test_unsupported_architecture(tmp_path):
    from localllm.backends.torch.models import build_model

    from ggufs import RawGGUF

    path = RawGGUF().kv_str("general.architecture", "mamba").write(tmp_path / "m.gguf")
    with GGUFFile(path) as f, pytest.raises(LocalLLMError) as e:
        build_model(f)
    msg = str(e.value)
    assert "\n" not in msg and "m.gguf" in msg and "'mamba'" in msg and "llama" in msg


CHATS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
]


def without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of `src` with its model keys and tensors (bytes as they are) and no vocabulary:
    parsing 49,152 tokens and merges twice is most of what transformers spends loading SmolLM2,
    and the model's math does not read them."""
    import gguf

    with GGUFFile(src) as f:
        arch = f.architecture
        w = gguf.GGUFWriter(str(dst), arch=arch)
        for key, value in f.metadata.items():
            if not key.startswith(f"{arch}."):
                continue
            if isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
        if f"{arch}.vocab_size" not in f.metadata:  # what transformers would count from tokens
            w.add_vocab_size(len(f.metadata["tokenizer.ggml.tokens"]))
        for name, info in f.tensors.items():
            shape = tuple(reversed(info.shape))  # torch order; the last dim as bytes per row
            t = info.ggml_type
            row = shape[-1] // t.block_size * t.type_size
            data = np.frombuffer(f.tensor_bytes(name), dtype=np.uint8).reshape(*shape[:-1], row)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(t.id))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst


def greedy_matches_transformers(path: Path, chats: list[str], template: str, *, add_bos: bool,
                                 tmp_path: Path, n_new: int = 128) -> None:  # fmt: skip
    """`n_new` greedy tokens per chat prompt, decoded through our caches one row at a time, must
    be the tokens transformers' argmax picks at every step (teacher-forced: one forward per
    prompt, which holds exactly when transformers' own greedy loop would produce the same
    tokens). Rows run one at a time: batched rows are checked on the tiny models, and a B > 1
    matmul is what a busy 2-core machine runs slowest (MKL's threads wait on each other)."""
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python tokenizes the prompts)")
    import llama_cpp
    from transformers import AutoModelForCausalLM

    from localllm.backends.torch.models import build_model

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    prompts = [
        vocab.tokenize(template.format(q).encode(), add_bos=add_bos, special=True) for q in chats
    ]
    del vocab
    with GGUFFile(path) as f:
        model = build_model(f)
    generated = []
    with torch.no_grad():
        for prompt in prompts:
            caches = [model.make_caches(len(prompt) + n_new)]
            token = model.logits(model(torch.tensor([prompt]), caches)[0, -1]).argmax()
            tokens = [token]
            for _ in range(n_new - 1):
                token = run(model, token.view(1, 1), caches)[0, -1].argmax()
                tokens.append(token)
            generated.append(torch.stack(tokens))
    del model, caches

    stripped = without_tokenizer(path, tmp_path / path.name)
    with transformers_gguf_loader():
        oracle = AutoModelForCausalLM.from_pretrained(
            stripped.parent, gguf_file=stripped.name, dtype=torch.float32
        ).eval()
    for prompt, gen in zip(prompts, generated):
        ids = torch.tensor([prompt + gen.tolist()])
        with torch.no_grad():
            logits = oracle(ids).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == gen.tolist()


def test_default_model_greedy_matches_transformers(default_model_path, tmp_path):
    """SmolLM2 (Llama; Q4_1 and Q8_0, dequantized to float32 by both sides), ChatML prompts."""
    template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    greedy_matches_transformers(
        default_model_path, CHATS, template, add_bos=False, tmp_path=tmp_path
    )


@pytest.mark.slow
def test_gemma_greedy_matches_transformers(request, tmp_path):
    """Gemma 3 270M (K-quants), with a prompt longer than its 512-token sliding window.
    About a minute and a half here, so it runs with `-m slow`."""
    if "slow" not in request.config.getoption("markexpr"):
        pytest.skip("Gemma 3 270M against transformers: run with -m slow")
    gemma_model_path = request.getfixturevalue("gemma_model_path")
    long = (" ".join(f"{i}" for i in range(300))) + ". What number came after 41?"
    template = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
    greedy_matches_transformers(
        gemma_model_path, [CHATS[0], long], template, add_bos=True, tmp_path=tmp_path, n_new=32
    )
