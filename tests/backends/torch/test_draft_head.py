"""EAGLE-style draft heads (`backends.torch.draft_head`): trained on a tiny random Llama's own
features for a few hundred steps, a head predicts the target's next token far better than the
same head untrained, on held-out text; drafting a token at a time over its cache gives what one
pass over the positions gives; the draft vocabulary is the text's most frequent tokens."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.torch.draft_head import DraftHead, frequent, losses  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.gguf_file import GGUFFile  # noqa: E402


@pytest.fixture(scope="module")
def target_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, dim 64, 384 tokens)."""
    from backends.torch.test_models import hf_model, write_gguf

    return write_gguf(hf_model("llama"), tmp_path_factory.mktemp("llama") / "llama.gguf")


def built(path: Path):  # noqa: ANN201
    from localllm.backends.torch.models import build_model

    with GGUFFile(path) as f:
        return build_model(f)


@pytest.fixture(scope="module")
def target(target_path: Path):  # noqa: ANN201
    """The tiny Llama built by the torch engine, frozen."""
    return built(target_path)


def passes(model, tokens: torch.Tensor):  # noqa: ANN001, ANN201
    """The target over rows of tokens (B, T): its embeddings, features, logits."""
    from localllm.backends.torch.draft_head import features

    feats, logits = features(model, tokens)
    with torch.no_grad():
        return model.embed(tokens), feats, logits


def make_head(model, vocab: torch.Tensor) -> DraftHead:  # noqa: ANN001
    a = model.args
    torch.manual_seed(0)
    return DraftHead(a.dim, a.n_heads, a.n_kv_heads, 2 * a.dim, vocab)


def test_training_on_the_targets_features_beats_the_untrained_head(target) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(1)
    # text the target wrote itself would be better; random text still has its structure to learn
    train = torch.randint(0, 384, (64, 48), generator=g)
    held = torch.randint(0, 384, (16, 48), generator=g)
    vocab = frequent(train.flatten(), 256, 384)
    rows = target.output.weight.detach()[vocab]
    head = make_head(target, vocab)
    emb, feats, logits = passes(target, held)
    with torch.no_grad():
        before = losses(head, emb[:, 1:], feats, logits, rows)
    data = passes(target, train)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for step in range(300):
        i = torch.arange(8) + 8 * (step % 8)
        out = losses(head, data[0][i, 1:], data[1][i], data[2][i], rows)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    with torch.no_grad():
        after = losses(head, emb[:, 1:], feats, logits, rows)
    assert float(after["kl"]) < 0.5 * float(before["kl"]), (before, after)
    assert float(after["agree"]) > float(before["agree"]) + 0.2, (before, after)


def test_drafting_over_the_cache_is_one_pass_over_the_positions(target) -> None:  # noqa: ANN001
    head = make_head(target, torch.arange(384))
    emb, feats, _ = passes(target, torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        whole, _ = head(emb, feats)
        first, cache = head(emb[:, :7], feats[:, :7])
        rest = []
        for t in range(7, 12):  # a token at a time, as drafting goes
            g, cache = head(emb[:, t : t + 1], feats[:, t : t + 1], t, cache)
            rest.append(g)
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache[0].shape == (2, target.args.n_kv_heads, 12, head.head_dim)


def test_unrolled_steps_are_what_drafting_over_the_cache_gives(target) -> None:  # noqa: ANN001
    """Training-time test: step s of row r is the head drafting s tokens after position r
    (its entries 0 .. r over the target's features, then its own g fed back a token at a time),
    for every row at once."""
    head = make_head(target, torch.arange(384))
    tokens = torch.randint(0, 384, (2, 10), generator=torch.Generator().manual_seed(6))
    emb, feats, _ = passes(target, tokens)
    with torch.no_grad():
        gs = head.unrolled(emb[:, 1:], feats[:, :9], 3)
        for r in (0, 4, 6):
            g, cache = head(emb[:, 1 : r + 2], feats[:, : r + 1])
            g = g[:, -1:]
            torch.testing.assert_close(gs[0][:, r : r + 1], g, rtol=1e-5, atol=1e-5)
            for s in (2, 3):
                g, cache = head(emb[:, r + s : r + s + 1], g, r + s - 1, cache)
                torch.testing.assert_close(gs[s - 1][:, r : r + 1], g, rtol=1e-5, atol=1e-5)


def test_the_draft_vocabulary_is_the_most_frequent_tokens() -> None:
    text = [5, 5, 5, 9, 9, 1, 7, 7, 2, 2]
    assert frequent(text, 3, 10).tolist() == [2, 5, 7]  # 5 ×3; then 2, 7 and 9 ×2: ties by id
    assert frequent(text, 50, 10).tolist() == list(range(10))


def test_a_head_refuses_shapes_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="cannot split"):
        DraftHead(60, 8, 2, 128, torch.arange(4))


def test_a_broken_head_file_is_one_line(tmp_path: Path) -> None:
    from localllm.backends.torch.train_draft import load_head

    (tmp_path / "head.pt").write_bytes(b"\x80\x04 not a safetensors file")
    with pytest.raises(LocalLLMError, match="head.pt: not a draft head"):
        load_head(tmp_path / "head.pt", "d" * 64)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.pt"))  # safetensors, not ours
    with pytest.raises(LocalLLMError, match="other.pt: not a draft head this version"):
        load_head(tmp_path / "other.pt", "d" * 64)


# -- training runs (train_draft) ---------------------------------------------------------------


def saved(path: Path) -> dict:
    """What a head file or checkpoint holds: its metadata, "head" its parameters."""
    from localllm.backends.torch.train_draft import _load

    meta, tensors = _load(path, "d" * 64)
    return meta | {"head": {k: v for k, v in tensors.items() if k.startswith("head.")}}


def text_of(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_training_run_writes_a_head_that_agrees_with_the_target(target, tmp_path: Path) -> None:  # noqa: ANN001
    from localllm.backends.torch.draft_head import DraftHead as Head
    from localllm.backends.torch.train_draft import Progress, head_rows, load_head, train

    seen: list[Progress] = []
    out = train(target, text_of(64 * 32), tmp_path / "head.pt", digest="d" * 64, tokens=300 * 4 * 32,
                seq=32, batch=4, lr=3e-3, report=seen.append)  # fmt: skip
    assert out.exists() and not (tmp_path / "head.pt.partial").exists()
    assert seen[-1].done and seen[-1].step == 300 and seen[-1].tokens == 300 * 4 * 32
    head = load_head(out, "d" * 64)
    held = torch.tensor(text_of(64 * 32)).view(64, 32)[15::16]  # the windows training left out
    rows = head_rows(target, head.vocab)
    fresh = Head(**{k: head.config[k] for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim")},
                 vocab=head.vocab, head_dim=head.head_dim)  # fmt: skip
    with torch.no_grad():
        emb, feats, logits = passes(target, held)
        trained, untrained = (float(losses(h, emb[:, 1:], feats, logits, rows)["agree"][0])
                              for h in (head, fresh))  # fmt: skip
    # the run measured it on float16 copies of the features
    assert trained > untrained + 0.2 and seen[-1].agree == pytest.approx(trained, abs=0.03), (trained, untrained)
    with pytest.raises(LocalLLMError, match="trained for another model"):
        load_head(out, "e" * 64)


def test_a_stopped_run_resumes_where_its_checkpoint_was(target, tmp_path: Path) -> None:  # noqa: ANN001
    """Stopped after step 23 (its last checkpoint at 20), run again: the head is the one an
    uninterrupted run trains, bit for bit."""
    from localllm.backends.torch.train_draft import Progress, train

    text, kw = text_of(32 * 32), {"seq": 32, "batch": 4, "lr": 3e-3, "every": 10, "digest": "d" * 64}
    whole = saved(train(target, text, tmp_path / "whole.pt", tokens=40 * 128, **kw))

    class Stop(Exception):
        pass

    def stop_at_23(p: Progress) -> None:
        if p.step == 23:
            raise Stop

    with pytest.raises(Stop):
        train(target, text, tmp_path / "resumed.pt", tokens=40 * 128, report=stop_at_23, **kw)
    assert saved(tmp_path / "resumed.pt.partial")["step"] == 20
    with pytest.raises(LocalLLMError, match="another model"):  # a checkpoint of another model
        train(target, text, tmp_path / "resumed.pt", tokens=40 * 128, **(kw | {"digest": "e" * 64}))
    first: list[int] = []
    resumed = saved(train(target, text, tmp_path / "resumed.pt", tokens=40 * 128,
                               report=lambda p: first.append(p.step), **kw))  # fmt: skip
    assert first[0] == 21  # it went on from the checkpoint
    assert resumed["step"] == whole["step"] == 40
    for name, t in whole["head"].items():
        assert torch.equal(resumed["head"][name], t), name


def test_too_little_text_is_one_line(target, tmp_path: Path) -> None:  # noqa: ANN001
    from localllm.backends.torch.train_draft import train

    with pytest.raises(LocalLLMError, match="too few to train"):
        train(target, text_of(40), tmp_path / "h.pt", digest="d", tokens=100, seq=32)


KILLED = """
import sys, time, torch
sys.path[:0] = {paths!r}
torch.set_num_threads({threads})
from test_draft_head import built, text_of
from localllm.backends.torch.train_draft import train
train(built(__import__("pathlib").Path({model!r})), text_of(32 * 32), __import__("pathlib").Path({out!r}),
      digest="d" * 64, tokens=10**9, seq=32, batch=4, lr=3e-3, every=10,
      report=lambda p: time.sleep(0.02))
"""


def test_a_run_killed_at_any_moment_resumes_from_its_last_checkpoint(
    target, target_path: Path, tmp_path: Path  # noqa: ANN001
) -> None:
    """kill -9 of a training process (past its second checkpoint), then the same run again
    here: it goes on from the checkpoint, and the head is the one an unkilled run trains."""
    import signal
    import subprocess
    import sys

    from localllm.backends.torch.train_draft import train

    out = tmp_path / "killed.pt"
    here = Path(__file__).parent
    code = KILLED.format(paths=[str(here), str(here.parent.parent)], threads=torch.get_num_threads(),
                         model=str(target_path), out=str(out))  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code])
    partial = out.with_name(out.name + ".partial")
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if partial.exists() and saved(partial)["step"] >= 20:
                break
            time.sleep(0.05)
        assert child.poll() is None, "the training process ended by itself"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    at = saved(partial)["step"]
    assert at >= 20 and at % 10 == 0
    steps = at + 15
    kw = {"seq": 32, "batch": 4, "lr": 3e-3, "every": 10, "digest": "d" * 64}
    first: list[int] = []
    resumed = saved(train(target, text_of(32 * 32), out, tokens=steps * 128,
                               report=lambda p: first.append(p.step), **kw))  # fmt: skip
    assert first[0] == at + 1  # it went on from the checkpoint
    whole = saved(train(target, text_of(32 * 32), tmp_path / "whole.pt", tokens=steps * 128, **kw))
    assert resumed["step"] == whole["step"] == steps
    for name, t in whole["head"].items():
        assert torch.equal(resumed["head"][name], t), name


def test_features_are_what_the_targets_output_head_reads(target) -> None:  # noqa: ANN001
    """EAGLE's heads read the base model's output, after its final norm: through the output
    head's rows (all of them here), the features give the target's logits, and a head's draft
    distribution is that product over its own rows."""
    from localllm.backends.torch.draft_head import features

    feats, logits = features(target, torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(4)))
    rows = target.output.weight.detach()
    with torch.no_grad():
        torch.testing.assert_close(DraftHead.logits(feats, rows), logits)
        torch.testing.assert_close(DraftHead.logits(feats, rows[:7]), logits[..., :7])
        capped = DraftHead.logits(feats, rows, cap=2.0)
    torch.testing.assert_close(capped, torch.tanh(logits / 2.0) * 2.0)


# -- published heads (EAGLE-1's layout) -------------------------------------------------------


def eagle_folder(folder: Path, *, bias: bool = True):  # noqa: ANN201
    """A random EAGLE-1 head saved as its authors publish one: config.json and model.safetensors
    (fc, then a transformers Llama decoder layer without its input norm). Returns (fc, layer,
    config) for the oracle."""
    import transformers
    from safetensors.torch import save_file
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=384,
                                      rope_theta=10000.0, rms_norm_eps=1e-6)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(5)
    fc = torch.nn.Linear(128, 64, bias=bias)
    layer = modeling_llama.LlamaDecoderLayer(config, 0)
    layer.input_layernorm = torch.nn.Identity()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5) if p.dim() > 1 else 1 + 0.2 * torch.randn_like(p))
    tensors = {f"fc.{k}": v for k, v in fc.state_dict().items()}
    tensors |= {f"layers.0.{k}": v for k, v in layer.state_dict().items()}
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(config.to_json_string())
    return fc, layer, config


def test_a_published_eagle_head_computes_what_its_authors_layer_does(tmp_path: Path) -> None:
    """Oracle: transformers' own Llama decoder layer (EAGLE-1's draft layer) behind the head's
    fc, on the same inputs; the loaded head gives its outputs at every position."""
    from transformers.models.llama import modeling_llama

    from localllm.backends.torch.train_draft import load_published

    for bias in (True, False):
        folder = tmp_path / f"eagle-{bias}"
        fc, layer, config = eagle_folder(folder, bias=bias)
        head = load_published(folder, 384)
        assert head.vocab.tolist() == list(range(384))
        emb, feat = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
        pos = torch.arange(10).unsqueeze(0)
        with torch.no_grad():
            x = fc(torch.cat((emb, feat), dim=-1))
            cos_sin = modeling_llama.LlamaRotaryEmbedding(config)(x, pos)
            want = layer(x, position_ids=pos, position_embeddings=cos_sin)
            want = want[0] if isinstance(want, tuple) else want
            got, _ = head(emb, feat)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_published_heads_it_cannot_read_are_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from localllm.backends.torch.train_draft import load_published

    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04.")
    with pytest.raises(LocalLLMError, match="pickle, which localllm never loads"):
        load_published(folder, 384)
    eagle_folder(tmp_path / "eagle3")
    save_file({"midlayer.x": torch.zeros(1)}, str(tmp_path / "eagle3" / "model.safetensors"))
    with pytest.raises(LocalLLMError, match=r"no tensor for .* \(EAGLE-3 layout\)"):
        load_published(tmp_path / "eagle3", 384, 8)
    eagle_folder(tmp_path / "short")
    save_file({"fc.weight": torch.zeros(64, 128)}, str(tmp_path / "short" / "model.safetensors"))
    with pytest.raises(LocalLLMError, match="no tensor for wqkv.weight"):
        load_published(tmp_path / "short", 384)


# -- EAGLE-3's published heads ------------------------------------------------------------------


def eagle3_folder(folder: Path, d2t: torch.Tensor, *, dim: int = 64, ffn: int = 128) -> None:
    """A random EAGLE-3 head as its authors publish one (SafeAILab/EAGLE's names: `fc` over three
    layers' features, `midlayer` reading [norm(embedding); norm(feature)], its own `norm` and
    `lm_head` over a draft vocabulary mapped to target ids by `d2t`), for the tiny Llama."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(11)
    heads, kv, hd, draft = 4, 2, dim // 4, len(d2t)
    shapes = {
        "fc.weight": (dim, 3 * dim),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * dim),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * dim),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * dim),
        "midlayer.self_attn.o_proj.weight": (dim, heads * hd),
        "midlayer.mlp.gate_proj.weight": (ffn, dim), "midlayer.mlp.up_proj.weight": (ffn, dim),
        "midlayer.mlp.down_proj.weight": (dim, ffn), "lm_head.weight": (draft, dim),
    }  # fmt: skip
    tensors = {k: torch.randn(s) / s[-1] ** 0.5 for k, s in shapes.items()}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = 1 + 0.2 * torch.randn(dim)
    tensors["d2t"] = d2t
    tensors["t2d"] = torch.zeros(384, dtype=torch.bool)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": dim, "intermediate_size": ffn,
        "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
        "vocab_size": 384, "draft_vocab_size": draft, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}))  # fmt: skip


def eagle3_reference(t: dict[str, torch.Tensor], feats: list[torch.Tensor], emb: torch.Tensor,
                     eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """EAGLE-3's draft layer over entries 0 .. n-1 (positions), written out from its authors'
    description as vLLM runs it: entry i reads emb[i] and feats[i] — three layers' hidden states
    (3·dim: through fc) or the previous entry's output (dim: as is) — and attends causally.
    Returns each entry's output before the final norm, (n, dim)."""

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    m = "midlayer."
    g = torch.stack([t["fc.weight"] @ f if f.shape[-1] != emb.shape[-1] else f for f in feats])
    x = torch.cat((rms(emb, t[m + "input_layernorm.weight"]), rms(g, t[m + "hidden_norm.weight"])), -1)
    n, hd = len(x), 16
    q = (x @ t[m + "self_attn.q_proj.weight"].T).view(n, 4, hd).transpose(0, 1)
    k = (x @ t[m + "self_attn.k_proj.weight"].T).view(n, 2, hd).transpose(0, 1)
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, 2, hd).transpose(0, 1)
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(n).float()[:, None] * inv
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)

    def rope(z: torch.Tensor) -> torch.Tensor:  # transformers' rotate_half
        return z * cos + torch.cat((-z[..., hd // 2 :], z[..., : hd // 2]), -1) * sin

    q, k = rope(q), rope(k).repeat_interleave(2, 0)
    scores = (q @ k.transpose(-1, -2)) / hd**0.5 + torch.full((n, n), float("-inf")).triu(1)
    a = (scores.softmax(-1) @ v.repeat_interleave(2, 0)).transpose(0, 1).reshape(n, -1)
    r = g + a @ t[m + "self_attn.o_proj.weight"].T
    h = rms(r, t[m + "post_attention_layernorm.weight"])
    up = torch.nn.functional.silu(h @ t[m + "mlp.gate_proj.weight"].T) * (h @ t[m + "mlp.up_proj.weight"].T)
    return r + up @ t[m + "mlp.down_proj.weight"].T


def test_a_published_eagle3_head_drafts_from_three_layers(tmp_path: Path) -> None:
    """A random EAGLE-3 head in its published layout, on an 8-layer tiny Llama: its drafts over a
    prompt and then over its own first draft are what EAGLE-3's layer computes from the hidden
    states going into layers 2, 4 and 5 (transformers' own `output_hidden_states` of the same
    model: the oracle for which states those are), through its own rows, mapped by d2t."""
    from backends.torch.test_models import hf_model, write_gguf
    from safetensors.torch import load_file

    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner
    from localllm.backends.torch.train_draft import load_published, save_head

    hf = hf_model("llama", num_hidden_layers=8)
    gguf = write_gguf(hf, tmp_path / "llama8.gguf")
    d2t = torch.sort(torch.randperm(380)[:100]).values - torch.arange(100)  # draft row i → i + d2t[i]
    eagle3_folder(tmp_path / "eagle3", d2t)
    head = load_published(tmp_path / "eagle3", 384, 8)
    assert head.taps == (2, 4, 5) and head.vocab.tolist() == (torch.arange(100) + d2t).tolist()
    path = save_head(head, tmp_path / "head.safetensors", "f" * 64)
    r = TorchRunner(gguf, n_ctx=128, n_slots=1, dtype="f32", kv_cache="f32", threads=2, compile="off")
    try:
        r.use_head(path, "f" * 64)
        ids = [int(x) for x in torch.randint(3, 384, (20,), generator=torch.Generator().manual_seed(3))]
        last = 77
        r.forward([Piece(0, ids, 1)])
        first = r.head_logits(0, last)
        draft = int(first.argmax())
        second = r.head_logits(0, draft)
        r.head_done(0)
    finally:
        r.close()
    t = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        feats = [torch.cat([states[i][0, p] for i in (2, 4, 5)]) for p in range(len(ids))]
        emb = hf.model.embed_tokens(torch.tensor([*ids[1:], last, draft]))
        out = eagle3_reference(t, feats, emb[:-1])
        out = eagle3_reference(t, [*feats, out[-1]], emb)  # the draft reads the first's output
        target = head.vocab.numpy()
        for got, g in ((first, out[-2]), (second, out[-1])):
            z = g * torch.rsqrt(g.pow(2).mean() + 1e-6) * t["norm.weight"]
            want = (t["lm_head.weight"] @ z).numpy()
            assert np.isinf(np.delete(got, target)).all()
            np.testing.assert_allclose(got[target], want, rtol=1e-4, atol=1e-4)


def test_a_broken_eagle3_head_is_one_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from localllm.backends.torch.train_draft import load_published

    eagle3_folder(tmp_path / "e", torch.zeros(50, dtype=torch.long))
    with pytest.raises(LocalLLMError, match="reads three layers of a deeper model than one of 2"):
        load_published(tmp_path / "e", 384, 2)
    t = load_file(str(tmp_path / "e" / "model.safetensors"))
    del t["lm_head.weight"]
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    with pytest.raises(LocalLLMError, match=r"no tensor for lm_head.weight \(EAGLE-3 layout\)"):
        load_published(tmp_path / "e", 384, 8)
    t["lm_head.weight"] = torch.zeros(50, 64)
    t["d2t"] = torch.full((50,), 400)
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    with pytest.raises(LocalLLMError, match="d2t maps draft tokens outside"):
        load_published(tmp_path / "e", 384, 8)
