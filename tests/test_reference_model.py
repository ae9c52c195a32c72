import math

import pytest
import torch

from swan_dist.reference.model import MODEL_SIZES, Llama, LlamaConfig, apply_rope, model_config, rope_tables


def small_model(**overrides) -> Llama:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    return Llama(LlamaConfig(**{**cfg, **overrides}))


@pytest.mark.timeout(30)
def test_shapes_and_loss():
    model = small_model()
    tokens = torch.randint(0, 97, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 97)
    logits2, loss = model(tokens, tokens)
    assert torch.equal(logits, logits2)
    assert loss.shape == () and math.isclose(loss.item(), math.log(97), rel_tol=0.1)  # near-uniform at init
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.timeout(30)
def test_causal_future_tokens_do_not_change_past_logits():
    model = small_model().eval()
    tokens = torch.randint(0, 97, (2, 16))
    changed = tokens.clone()
    changed[:, 9:] = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.timeout(30)
def test_tied_head_shares_storage():
    tied = small_model(tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert [n for n, _ in tied.named_parameters()].count("output.weight") == 0
    untied = small_model()
    assert tied.num_params() == untied.num_params() - 97 * 32
    # writing through the head changes the embedding
    with torch.no_grad():
        tied.output.weight.mul_(2.0)
    torch.testing.assert_close(tied.tok_embeddings.weight, tied.output.weight)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


@pytest.mark.timeout(30)
def test_init_scales():
    model = Llama(model_config("tiny", vocab_size=8192, n_layers=8))
    assert abs(model.tok_embeddings.weight.std().item() - 0.02) < 1e-3
    assert abs(model.layers[0].attention.wq.weight.std().item() - 0.02) < 1e-3
    residual = 0.02 / math.sqrt(2 * 8)
    assert abs(model.layers[3].attention.wo.weight.std().item() - residual) < 5e-4
    assert abs(model.layers[3].feed_forward.w2.weight.std().item() - residual) < 5e-4
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in (model.norm, model.layers[0].ffn_norm))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "size, lo, hi",
    [("tiny", 2e6, 4e6), ("small", 15e6, 25e6), ("60m", 30e6, 38e6), ("130m", 90e6, 110e6)],
)
def test_named_size_param_counts(size, lo, hi):
    with torch.device("meta"):
        model = Llama(model_config(size, vocab_size=8192))
    assert lo <= model.num_params() <= hi
    names = {n for n, _ in model.named_parameters()}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight", "layers.0.attention.wq.weight",
            "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"} <= names
    assert not any("bias" in n for n in names)


@pytest.mark.timeout(30)
def test_size_presets_match_paper_shapes():
    assert model_config("60m").ffn_dim == 1376 and model_config("130m").ffn_dim == 2048
    assert MODEL_SIZES["130m"]["n_layers"] == 12
    with pytest.raises(ValueError, match="n_layer"):
        model_config("tiny", n_layer=3)
    with pytest.raises(ValueError, match="unknown model size"):
        model_config("huge")


@pytest.mark.timeout(30)
def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    head_dim, length = 16, 12
    cos, sin = rope_tables(head_dim, length)
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    rq = apply_rope(q.expand(1, 1, length, head_dim), cos, sin)[0, 0]  # q placed at every position
    rk = apply_rope(k.expand(1, 1, length, head_dim), cos, sin)[0, 0]
    scores = rq @ rk.T  # scores[m, n] = <R_m q, R_n k>
    for offset in range(-length + 1, length):
        diagonal = torch.diagonal(scores, offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(length))  # rotations keep norms
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 3)[0])
