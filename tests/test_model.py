"""The one model definition: exact published parameter counts, every option's shapes, learning."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_trainer.config import ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.model import Transformer, build_model, count_parameters
from dist_trainer.model_blocks import IGNORE_INDEX

# Published counts (REFERENCES.md; HF model cards): the model built on meta must equal them exactly.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,  # GQA: 8 kv heads of 64
    "bert-base": 109_482_240,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_equal_published(preset: str) -> None:
    model = build_model(model_config(preset), device="meta")
    assert count_parameters(model) == PUBLISHED[preset]


def test_bert_per_layer_and_embedding_counts() -> None:
    model = build_model(model_config("bert-base"), device="meta")
    per_layer = sum(p.numel() for p in model.layers[0].parameters())
    embeddings = sum(p.numel() for m in (model.tok_emb, model.pos_emb, model.type_emb, model.emb_norm)
                     for p in m.parameters())
    assert per_layer == 7_087_872  # with the attention biases (the 7,084,800 estimate forgets them)
    assert embeddings == 23_837_184
    assert sum(p.numel() for p in model.pooler.parameters()) == 590_592


def test_gpt2_padded_vocab_count() -> None:
    model = build_model(model_config("gpt2", vocab_size=50304), device="meta")
    assert count_parameters(model) == 124_475_904


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.0)
    base.update(kw)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


OPTIONS = list(itertools.product(
    ["learned", "sinusoidal", "rope"], ["layernorm", "rmsnorm"], ["pre", "post"],
    ["gelu", "relu", "swiglu"], [True, False],
))


@pytest.mark.parametrize("pos,norm,placement,act,causal", OPTIONS)
def test_forward_shapes_every_option(pos: str, norm: str, placement: str, act: str, causal: bool) -> None:
    cfg = small(pos_embedding=pos, norm=norm, norm_placement=placement, activation=act, causal=causal,
                n_kv_heads=2, bias=norm == "layernorm", tie_embeddings=causal)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    loss = model(tokens, tokens)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters()), "every parameter gets a gradient"


def test_bert_style_token_types_and_pooler() -> None:
    cfg = small(norm_placement="post", causal=False, n_token_types=2, pooler=True)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    types = torch.zeros_like(tokens)
    types[:, 4:] = 1
    hidden = model.run_layers(model.embed(tokens, types))
    assert model.pool(hidden).shape == (2, cfg.d_model)
    # segment ids change the output: the type embedding is really added
    assert not torch.allclose(model(tokens, token_types=types), model(tokens))


def test_causal_model_ignores_the_future_and_encoder_does_not() -> None:
    tokens = torch.randint(0, 97, (1, 12))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 97
    for causal in (True, False):
        torch.manual_seed(0)
        model = Transformer(small(causal=causal, pos_embedding="rope"))
        same_prefix = torch.allclose(model(tokens)[0, :-1], model(changed)[0, :-1], atol=1e-6)
        assert same_prefix == causal


def test_gqa_and_mqa_are_attention_with_shared_kv() -> None:
    """A GQA model equals an MHA model whose k/v weights repeat each kv head over its group."""
    torch.manual_seed(0)
    gqa = Transformer(small(n_kv_heads=2, pos_embedding="rope"))
    mha = Transformer(small(n_kv_heads=4, pos_embedding="rope"))
    sd = gqa.state_dict()
    head_dim = 8
    for key in list(sd):
        if key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            t = sd[key].unflatten(0, (2, head_dim))
            sd[key] = t.repeat_interleave(2, dim=0).flatten(0, 1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-6)


def test_scaled_residual_init() -> None:
    torch.manual_seed(0)
    cfg = small(n_layers=8, d_model=256, n_heads=4)
    model = Transformer(cfg)
    std_q = model.layers[0].attn.q_proj.weight.std().item()
    std_o = model.layers[0].attn.o_proj.weight.std().item()
    assert abs(std_q - 0.02) < 0.002
    assert abs(std_o - 0.02 / (2 * 8) ** 0.5) < 0.0005


def test_same_seed_same_model_and_meta_then_materialise() -> None:
    cfg = small()
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    meta = build_model(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert torch.isfinite(meta(torch.randint(0, 97, (1, 4)))).all()


@pytest.mark.parametrize("mode,every", [("full", 1), ("every_k", 2)])
def test_activation_checkpointing_gives_identical_gradients(mode: str, every: int) -> None:
    cfg = small(n_layers=4)
    tokens = torch.randint(0, 97, (2, 12))
    grads = []
    for m in ("none", mode):
        model = build_model(cfg, seed=0)
        model.set_activation_checkpointing(m, every)
        model(tokens, tokens).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert model.checkpointed == (frozenset(range(4)) if mode == "full" else frozenset({0, 2}))
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)


@pytest.mark.parametrize("flavour", ["gpt2_dropout", "llama_gqa_rope"])
def test_selective_recomputation_gives_identical_loss_and_gradients(flavour: str) -> None:
    """The attention core runs again in backward; the replayed RNG state gives the same dropout masks."""
    cfg = small(n_layers=3, dropout=0.1) if flavour == "gpt2_dropout" else small(
        n_layers=3, n_kv_heads=2, pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False)
    tokens = torch.randint(0, 97, (2, 12))
    runs = []
    for mode in ("none", "selective"):
        model = build_model(cfg, seed=0)
        model.set_activation_checkpointing(mode)
        torch.manual_seed(5)  # the same dropout draws in both runs
        loss = model(tokens, tokens)
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert all(layer.attn.recompute_core for layer in model.layers) and model.checkpointed == frozenset()
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)
    for g0, g1 in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)
    model.set_activation_checkpointing("none")
    assert not any(layer.attn.recompute_core for layer in model.layers)


def test_activation_checkpointing_saves_less() -> None:
    """Full recomputation keeps only layer inputs: fewer bytes saved for backward."""
    cfg = small(n_layers=4)
    tokens = torch.randint(0, 97, (2, 16))

    def saved_bytes(mode: str) -> int:
        model = build_model(cfg, seed=0)
        model.set_activation_checkpointing(mode)
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, tokens)
        return sum(storages.values())

    assert saved_bytes("full") < 0.6 * saved_bytes("none")


def test_bf16_autocast_keeps_norms_and_loss_in_fp32() -> None:
    cfg = small(norm="rmsnorm", bias=False, activation="swiglu", pos_embedding="rope")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 97, (2, 8))
    x = torch.randn(2, 8, cfg.d_model).bfloat16()
    norm = model.layers[0].attn_norm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the norm computes in fp32 and rounds once: equal to the fp32 result cast to bf16
        assert torch.equal(norm(x), norm(x.float()).bfloat16())
        logits = model(tokens)
        loss = model(tokens, tokens)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    ref = build_model(cfg, seed=0)(tokens, tokens)
    assert abs(loss.item() - ref.item()) / ref.item() < 0.02  # bf16 forward close to fp32


def test_tiny_model_overfits_one_batch() -> None:
    cfg = small(n_layers=2, d_model=64, n_heads=4)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 97, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 4.0 and loss.item() < 0.1, (first, loss.item())


def test_mlm_loss_ignores_unmasked_positions() -> None:
    cfg = small(causal=False, norm_placement="post")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 97, (2, 8))
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[0, 3] = 5
    logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(logits[0, 3:4], targets[0, 3:4])
    torch.testing.assert_close(model(tokens, targets), expected)


def test_sequence_longer_than_max_raises() -> None:
    model = build_model(small(), seed=0)
    with pytest.raises(RuntimeError, match="exceeds model.max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
