"""The family registry (``dist_trainer/families/``): lookup, refusals, config.json both ways, recipes.

- a fused tensor interleaved per head (GPT-NeoX's ``query_key_value``, ``Recipe.period``) and partial rotary
  (``Recipe.rope_dims``) are read exactly, whole or by the rows (or columns) one TP rank owns, and the export
  writes the HF tensor back bit for bit; the references are built with plain indexing, not with the recipes;
- every preset of a family exports as that family, and its export's config.json reads back as the same fields;
- Llama's ``attention_bias``, ``mlp_bias`` and own ``head_dim``, Mistral's ``sliding_window`` map onto ModelConfig
  fields, and what a family cannot express is named when exporting.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dist_trainer.checkpoint.hf_export import _to_hf
from dist_trainer.checkpoint.source import HFSource, SafetensorsFiles, interleave_rope_rows, rotate_half_rope_rows
from dist_trainer.config_load import load_preset
from dist_trainer.config_model import ModelConfig
from dist_trainer.families import FAMILIES, Recipe, family, family_for_model, model_fields
from dist_trainer.families.common import MATHS_DEFAULTS

H, D, R, IN = 3, 8, 4, 5  # heads, head_dim, rotary dims (partial), input features


def _source(tmp_path: Path, tensors: dict[str, torch.Tensor], plan: dict[str, Recipe]) -> HFSource:
    """An HFSource over one safetensors file holding ``tensors``, read by ``plan`` (no config.json needed)."""
    file = tmp_path / "model.safetensors"
    save_file(tensors, str(file))
    src = HFSource.__new__(HFSource)
    src.where = str(tmp_path)
    src.files = SafetensorsFiles({name: file for name in tensors}, src.where)
    src.plan = plan
    return src


def _interleave_reference(w: torch.Tensor, head_dim: int, rope_dims: int) -> torch.Tensor:
    """Rows of each head: rotate_half pairs (i, i + R/2) of the first R rows to adjacent (2i, 2i + 1), by index."""
    order = []
    for h in range(w.shape[0] // head_dim):
        base = h * head_dim
        for i in range(rope_dims // 2):
            order += [base + i, base + rope_dims // 2 + i]
        order += list(range(base + rope_dims, base + head_dim))
    return w[order]


def _neox_plan(transpose: bool = False) -> dict[str, Recipe]:
    qkv = "query_key_value.weight"
    return {f"{leaf}.weight": Recipe(qkv, transpose, j * D, D, rope_head_dim=D if leaf != "v" else 0, period=3 * D,
                                     rope_dims=R if leaf != "v" else 0)
            for j, leaf in enumerate("qkv")} | {
        f"{leaf}.bias": Recipe("query_key_value.bias", False, j * D, D, rope_head_dim=D if leaf != "v" else 0,
                               period=3 * D, rope_dims=R if leaf != "v" else 0) for j, leaf in enumerate("qkv")}


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
def test_interleaved_fused_rows_with_partial_rotary_read_per_rank_and_write_back(tmp_path: Path,
                                                                                transpose: bool) -> None:
    w = torch.randn(3 * H * D, IN)
    b = torch.randn(3 * H * D)
    src = _source(tmp_path, {"query_key_value.weight": w.t().contiguous() if transpose else w,
                             "query_key_value.bias": b}, _neox_plan(transpose))
    per_head = w.view(H, 3, D, IN)
    per_head_b = b.view(H, 3, D)
    for j, leaf in enumerate("qkv"):
        want_w, want_b = per_head[:, j].reshape(H * D, IN), per_head_b[:, j].reshape(H * D)
        if leaf != "v":
            want_w, want_b = _interleave_reference(want_w, D, R), _interleave_reference(want_b, D, R)
        assert src.shape(f"{leaf}.weight") == (H * D, IN)
        assert torch.equal(src.read(f"{leaf}.weight"), want_w), leaf
        assert torch.equal(src.read(f"{leaf}.bias"), want_b), leaf
        for start, stop in ((0, D), (D, 3 * D), (3, 13)):  # a rank's heads, and rows inside heads
            assert torch.equal(src.read(f"{leaf}.weight", 0, start, stop), want_w[start:stop]), (leaf, start)
            assert torch.equal(src.read(f"{leaf}.bias", 0, start, stop), want_b[start:stop]), (leaf, start)
        assert torch.equal(src.read(f"{leaf}.weight", 1, 1, 4), want_w[:, 1:4]), leaf  # a row-parallel rank
    for hf_name, parts in (("query_key_value.weight", [(f"{x}.weight", src.plan[f"{x}.weight"]) for x in "qkv"]),
                           ("query_key_value.bias", [(f"{x}.bias", src.plan[f"{x}.bias"]) for x in "qkv"])):
        back = _to_hf(parts, src.read)
        assert torch.equal(back, src.files.read(hf_name)), hf_name


def test_a_recipe_reads_only_the_rows_a_rank_owns() -> None:
    r = Recipe("qkv", offset=D, rows=D, period=3 * D)
    assert r.our_rows(3 * H * D) == H * D
    assert r.hf_row_ranges(0, H * D) == [(D, 2 * D), (4 * D, 5 * D), (7 * D, 8 * D)]
    assert r.hf_row_ranges(D, 2 * D) == [(4 * D, 5 * D)]  # rank 1 of 3: its head's k rows only
    assert r.hf_row_ranges(3, D + 2) == [(D + 3, 2 * D), (4 * D, 4 * D + 2)]
    blocks = Recipe("qkv", offset=2 * D, rows=D)
    assert blocks.hf_row_ranges(1, 3) == [(2 * D + 1, 2 * D + 3)] and blocks.our_rows(99) == D
    with pytest.raises(ValueError, match="rope_dims=3 must be even"):
        Recipe("q", rope_head_dim=8, rope_dims=3)
    with pytest.raises(ValueError, match="period=8 needs offset"):
        Recipe("q", offset=4, rows=8, period=8)


@pytest.mark.parametrize("rope_dims", [0, R, D])
def test_rope_rows_permute_and_invert(rope_dims: int) -> None:
    w = torch.randn(H * D, IN)
    got = interleave_rope_rows(w, D, rope_dims)
    assert torch.equal(got, _interleave_reference(w, D, rope_dims or D))
    assert torch.equal(rotate_half_rope_rows(got, D, rope_dims), w)


def test_maths_defaults_are_the_model_configs() -> None:
    fields = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
              for f in dataclasses.fields(ModelConfig)}
    assert {k: fields[k] for k in MATHS_DEFAULTS} == MATHS_DEFAULTS


def test_lookup_names_the_supported_families_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"model_type 'falcon' is not supported; supported: gpt2, llama") as info:
        family("falcon", "x/config.json")
    assert str(info.value).startswith("x/config.json: ")
    assert all(FAMILIES[name].model_type == name for name in FAMILIES)


@pytest.mark.parametrize("preset", sorted({p for f in FAMILIES.values() for p in f.presets}))
def test_each_preset_exports_as_its_family_and_its_config_reads_back(preset: str) -> None:
    owner = next(f for f in FAMILIES.values() if preset in f.presets)
    cfg = ModelConfig(**load_preset(preset))
    model = {**dataclasses.asdict(cfg), "d_ff": cfg.ffn_dim}  # None = 4 * d_model, which the export states
    assert family_for_model(model) is owner
    config = owner.export_config(model, "float32")
    assert config["model_type"] == owner.model_type and config["architectures"][0].endswith(
        owner.architecture.removeprefix("Bert").removesuffix("ForMaskedLM"))
    back = model_fields(config, "export/config.json", set(owner.export_plan(model)))
    differ = {k: (model[k], v) for k, v in back.items() if k not in ("capacity_factor", "router_aux_loss",
                                                                      "router_z_loss", "dropout", "top_k")
              and model[k] != v}
    assert differ == {}, differ


LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}


def test_llama_biases_and_head_dim_and_mistral_window_map_onto_model_fields() -> None:
    got = model_fields({**LLAMA, "attention_bias": True, "mlp_bias": True, "head_dim": 16})
    assert (got["attn_qkv_bias"], got["attn_out_bias"], got["mlp_bias"], got["attn_head_dim"]) == (True, True, True, 16)
    assert model_fields({**LLAMA, "head_dim": 8})["attn_head_dim"] is None  # hidden_size / heads: the default
    cfg = ModelConfig(**{k: v for k, v in got.items()})
    cfg.validate()
    plan = FAMILIES["llama"].read_plan(dataclasses.asdict(cfg), set())
    assert plan["layers.0.attn.q_proj.bias"] == Recipe("model.layers.0.self_attn.q_proj.bias", rope_head_dim=16)
    assert "layers.1.attn.o_proj.bias" in plan and "layers.1.mlp.gate_proj.bias" in plan
    assert model_fields({**LLAMA, "model_type": "mistral", "sliding_window": 4096})["sliding_window"] == 4096
    assert model_fields({**LLAMA, "model_type": "mistral", "sliding_window": None})["sliding_window"] == 0
    exported = FAMILIES["llama"].export_config(dataclasses.asdict(cfg), "float32")
    assert (exported["attention_bias"], exported["mlp_bias"], exported["head_dim"]) == (True, True, 16)


@pytest.mark.parametrize(("change", "family_name", "named"), [
    ({"attn_qkv_bias": True}, "qwen2", None),  # Qwen2's biases: not a Llama
    ({"attn_qkv_bias": True, "mlp_bias": True}, None, "attention_bias sets both"),  # nobody's biases
    ({"sliding_window": 16}, "mistral", None),
    ({"sliding_window": 16, "sliding_window_pattern": 2}, None, "sliding_window_pattern=2"),
    ({"qk_norm": "head"}, "qwen3", None),
    ({"qk_norm": "head", "attn_qkv_bias": True}, None, "no Hugging Face family's"),  # Qwen3's norms, Qwen2's biases
    ({"attn_qkv_bias": True, "attn_out_bias": True, "mlp_bias": True}, "llama", None),
    ({"attn_head_dim": 16}, "llama", None),
])
def test_export_finds_the_family_or_names_what_it_lacks(change: dict, family_name: str | None,
                                                         named: str | None) -> None:
    model = dataclasses.asdict(ModelConfig(**{**load_preset("tiny"), "pos_embedding": "rope", "norm": "rmsnorm",
                                              "activation": "swiglu", "bias": False, **change}))
    if named is None:
        assert family_for_model(model).model_type == family_name
        return
    with pytest.raises(ValueError, match="export it with --format native") as info:
        family_for_model(model)
    assert named in str(info.value)


def _hf_model(kind: str) -> torch.nn.Module:
    """A tiny transformers model with every parameter drawn (transformers initialises biases to zero, which would
    hide a bias read from the wrong rows)."""
    import transformers  # the dev extra's parity reference (never imported by dist_trainer/)

    small = {"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 40, "max_position_embeddings": 64, "head_dim": 12}
    if kind == "llama":  # biases everywhere and a head_dim of its own (12, not 32 / 4)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, attention_bias=True, mlp_bias=True))
    else:  # a window shorter than the sequence
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=5))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_llama_with_biases_and_head_dim_and_mistral_with_a_window_give_transformers_logits(
        kind: str, tmp_path: Path) -> None:
    """Loaded from the folder, ours gives transformers' logits (1e-5) and greedy ids; the HF export is the input
    tensor for tensor (the recipes inverted) and reads back into transformers with its logits."""
    import transformers

    from dist_trainer.checkpoint.plain import load_plain_model
    from dist_trainer.train.export import export_checkpoint
    from dist_trainer.train.generate import sample

    theirs = _hf_model(kind)
    theirs.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    ours, cfg = load_plain_model(tmp_path / "in")
    assert cfg.model.head_dim == 12
    assert (cfg.model.attn_qkv_bias, cfg.model.mlp_bias, cfg.model.sliding_window) == \
        ((True, True, 0) if kind == "llama" else (None, None, 5))
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), kind
    prompt = tokens[:1, :4]
    ids = sample(ours, prompt, max_new_tokens=12, temperature=0.0)
    ref = theirs.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0,
                          eos_token_id=None)
    assert ids.tolist() == ref.tolist(), kind
    export_checkpoint(tmp_path / "in", tmp_path / "out")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert (config.model_type, config.head_dim) == (kind, 12)
    back, info = type(theirs).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert theirs.state_dict().keys() == back.state_dict().keys()
    assert all(torch.equal(theirs.state_dict()[k], v) for k, v in back.state_dict().items())
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens).logits, want)


def test_a_model_exports_as_its_own_family_when_another_computes_the_same_maths() -> None:
    """Phi-3-mini (full rotary, a window on every layer) computes what Mistral does: its hf_family (the folder's
    model_type, or the preset's) sends it back as Phi-3; without one the registry's order decides; a family that no
    longer computes the model (a bias added) is passed over for one that does."""
    cfg = ModelConfig(**load_preset("phi-3-mini"))
    model = {**dataclasses.asdict(cfg), "d_ff": cfg.ffn_dim}
    assert family_for_model(model).model_type == "phi3"
    assert family_for_model({**model, "hf_family": None}).model_type == "mistral"
    assert family_for_model({**model, "attn_qkv_bias": True, "attn_out_bias": False}).model_type == "qwen2"
    folder = model_fields({"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "intermediate_size": 48})
    assert folder["hf_family"] == "phi3"
