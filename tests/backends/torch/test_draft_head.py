"""EAGLE-style draft heads (`backends.torch.draft_head`): trained on a tiny random Llama's own
features for a few hundred steps, a head predicts the target's next token far better than the
same head untrained, on held-out text; drafting a token at a time over its cache gives what one
pass over the positions gives; the draft vocabulary is the text's most frequent tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.torch.draft_head import DraftHead, frequent, losses  # noqa: E402
from localllm.gguf_file import GGUFFile  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A tiny random Llama (2 layers, dim 64, 384 tokens) built by the torch engine, frozen."""
    from backends.torch.test_models import hf_model, write_gguf

    from localllm.backends.torch.models import build_model

    path = write_gguf(hf_model("llama"), tmp_path_factory.mktemp("llama") / "llama.gguf")
    with GGUFFile(path) as f:
        return build_model(f)


def passes(model, tokens: torch.Tensor):  # noqa: ANN001, ANN201
    """The target over rows of tokens (B, T): its embeddings, normed features, logits."""
    with torch.no_grad():
        h = model(tokens, [model.make_caches(tokens.shape[1]) for _ in range(len(tokens))])
        return model.embed(tokens), h, model.logits(h)


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
    assert float(after["feature"]) < 0.7 * float(before["feature"]), (before, after)
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


def test_the_draft_vocabulary_is_the_most_frequent_tokens() -> None:
    text = [5, 5, 5, 9, 9, 1, 7, 7, 2, 2]
    assert frequent(text, 3, 10).tolist() == [2, 5, 7]  # 5 ×3; then 2, 7 and 9 ×2: ties by id
    assert frequent(text, 50, 10).tolist() == list(range(10))


def test_a_head_refuses_shapes_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="cannot split"):
        DraftHead(60, 8, 2, 128, torch.arange(4))


def test_the_module_loads_without_a_path(tmp_path: Path) -> None:
    """A trained head's state (not yet stored by a command: issue 36) round-trips."""
    head = DraftHead(64, 4, 2, 128, torch.tensor([3, 1, 2]))
    torch.save(head.state_dict(), tmp_path / "head.pt")
    again = DraftHead(64, 4, 2, 128, torch.zeros(3, dtype=torch.long))
    again.load_state_dict(torch.load(tmp_path / "head.pt"))
    assert again.vocab.tolist() == [3, 1, 2]
