"""Hugging Face T5 folders in and out (issue 24), against ``transformers`` itself (a test-only dependency).

Tiny random T5 (ReLU, tied head scaled by d_model**-0.5) and T5 v1.1 (gated-GELU, untied head) models are saved by
``transformers`` in several shards: our model loaded from the folder gives transformers' logits (fp32, 1e-5) with a
padded source, and its greedy ids (ours through the KV cache, transformers' recomputed without one); our export
(``export --format hf``) of the loaded model loads back into transformers with no missing or unexpected key and the
same logits, its tensors bitwise the input's; an export of our own model (a seed's draw, not a folder's) does too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the dev extra's parity reference (never imported by dist_trainer/)

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.checkpoint.source import open_source
from dist_trainer.config import ModelConfig
from dist_trainer.files import write_safetensors
from dist_trainer.model import build_model
from dist_trainer.train.export import export_checkpoint
from dist_trainer.train.generate import generate, seq2seq_steps

VOCAB = 101


def _t5(**kw: Any) -> Any:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                dropout_rate=0.0, decoder_start_token_id=0, **kw)
    return transformers.T5ForConditionalGeneration(cfg)


@pytest.fixture(scope="module")
def t5_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("t5")
    torch.manual_seed(0)
    v10 = _t5(feed_forward_proj="relu")
    v11 = _t5(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    # transformers 5 ties every T5 head in memory; v1.1's own checkpoints hold a separate lm_head
    v11.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.3)
    folders = {}
    for name, model in (("t5", v10), ("t5-v1_1", v11)):
        with torch.no_grad():  # larger weights than T5's init, so greedy decoding does not repeat one token
            for p in model.parameters():
                p.mul_(3.0)
        model.save_pretrained(root / name, max_shard_size="20KB")
        assert len(list((root / name).glob("model-*.safetensors"))) > 1, name
        folders[name] = root / name
    return folders


def _reference(folder: Path) -> Any:
    return transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    source = torch.randint(2, VOCAB, (3, 13), generator=g)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 8:] = 0  # a padded source
    mask[2, 11:] = 0
    decoder = torch.randint(2, VOCAB, (3, 9), generator=g)
    decoder[:, 0] = 0
    return source, mask, decoder


@pytest.mark.parametrize("name", ["t5", "t5-v1_1"])
def test_folder_gives_transformers_logits_and_greedy_ids(name: str, t5_folders: dict[str, Path]) -> None:
    folder = t5_folders[name]
    ours, cfg = load_plain_model(folder)
    assert cfg.model.tie_embeddings == (name == "t5") and cfg.model.scale_head_input == (name == "t5")
    assert cfg.model.activation == ("relu" if name == "t5" else "geglu")
    theirs = _reference(folder)
    source, mask, decoder = _batch()
    with torch.no_grad():
        want = theirs(input_ids=source, attention_mask=mask, decoder_input_ids=decoder).logits
        got = ours(source, decoder_tokens=decoder, source_mask=mask.bool())
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), name
    for row in range(2):
        src = source[row:row + 1, :int(mask[row].sum())]
        ref = theirs.generate(input_ids=src, max_new_tokens=16, min_new_tokens=16, do_sample=False, num_beams=1,
                              eos_token_id=None, use_cache=False, output_scores=True, return_dict_in_generate=True)
        steps = list(seq2seq_steps(ours, src[0].tolist(), 16, temperature=0.0))
        assert [t for t, _ in steps] == ref.sequences[0, 1:].tolist(), name
        assert len(set(ref.sequences[0].tolist())) > 3, "a degenerate reference (one token repeated)"
        scores = torch.stack([s[0].float() for s in ref.scores])  # the logits of each step
        logprobs = torch.log_softmax(scores, -1).gather(1, ref.sequences[0, 1:, None])[:, 0]
        tolerance = 1e-5 * max(1.0, scores.abs().max().item())  # as the logits: relative to their size
        assert torch.allclose(torch.tensor([lp for _, lp in steps]), logprobs, atol=tolerance, rtol=0), name
    # generate --source-ids (the CLI's function): the same ids, with the folder's EOS ignored
    result = generate(folder, source_ids=source[0].tolist(), max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert result.as_json()["source_ids"] == source[0].tolist()
    assert result.ids == [t for t, _ in seq2seq_steps(ours, source[0].tolist(), 16, temperature=0.0)]
    with pytest.raises(ValueError, match="--source"):
        generate(folder, prompt_ids=[1, 2, 3], max_new_tokens=4)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("name", ["t5", "t5-v1_1"])
def test_export_round_trip_loads_back_into_transformers(name: str, t5_folders: dict[str, Path],
                                                        tmp_path: Path) -> None:
    folder = t5_folders[name]
    out = tmp_path / "export"
    export_checkpoint(folder, out, max_shard_size="30KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert _tensors(out).keys() == _tensors(folder).keys()
    assert all(torch.equal(a, _tensors(folder)[k]) for k, a in _tensors(out).items())
    theirs, info = transformers.T5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    source, mask, decoder = _batch()
    with torch.no_grad():
        want = _reference(folder)(input_ids=source, attention_mask=mask, decoder_input_ids=decoder).logits
        got = theirs.eval()(input_ids=source, attention_mask=mask, decoder_input_ids=decoder).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("tied", [True, False])
def test_our_own_model_exports_to_transformers(tied: bool, tmp_path: Path) -> None:
    """A model drawn from a seed (the t5 presets' shape in miniature), exported through a native export folder."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_decoder_layers=2, n_heads=4, d_ff=40,
                      max_seq_len=64, pos_embedding="relative", rel_buckets=16, rel_max_distance=40, norm="rmsnorm",
                      norm_eps=1e-6, bias=False, activation="relu" if tied else "geglu", tie_embeddings=tied,
                      scale_head_input=tied, attn_scale=False, dropout=0.0, init_std=0.3)
    ours = build_model(cfg, seed=3).eval()
    native = tmp_path / "native"
    native.mkdir()
    write_safetensors({k: v.contiguous() for k, v in ours.state_dict().items()}, native / "model.safetensors")
    import dataclasses

    (native / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert open_source(native).names() == set(ours.state_dict())
    export_checkpoint(native, tmp_path / "hf")
    theirs, info = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    source, mask, decoder = _batch()
    with torch.no_grad():
        want = theirs.eval()(input_ids=source, attention_mask=mask, decoder_input_ids=decoder).logits
        got = ours(source, decoder_tokens=decoder, source_mask=mask.bool())
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_t5_config_keys_that_change_the_maths_are_refused(t5_folders: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    for key, value, needle in (("feed_forward_proj", "gated-silu", "feed_forward_proj"), ("d_kv", 4, "d_kv"),
                               ("is_encoder_decoder", False, "is_encoder_decoder")):
        folder = tmp_path / key
        shutil.copytree(t5_folders["t5"], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=needle):
            load_plain_model(folder)


# A run from a T5 folder (train.init_from: the model section from its config.json) on seq2seq pairs, one step at
# lr 0 in each layout: its loss is the single process's, which is transformers' own loss on that batch; the tp=2
# run's checkpoint exported with `export --format hf` is the input folder, tensor for tensor.
PAIRS_VOCAB = 512  # tests/conftest.pairs_data's vocabulary
LAYOUTS = {"tp2sp": {"tp_size": 2, "sequence_parallel": True}, "pp2": {"pp_size": 2, "pp_schedule": "gpipe"}}


def _run_from(data: Path, out: Path, folder: Path, parallel: dict[str, Any]) -> dict[str, Any]:
    from dist_trainer.train.trainer import Trainer
    from tests.helpers import curves, tiny_config

    cfg = tiny_config(data, out, model={"preset": "tiny"}, parallel=parallel,
                      data={"objective": "seq2seq", "seq_len": 32, "target_len": 24},
                      optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    return curves(Trainer(cfg, log=False).train())


def _layouts(rank: int, world: int, data: Path, root: Path, folder: Path) -> dict[str, Any]:
    return {name: _run_from(data, root / name, folder, parallel) for name, parallel in LAYOUTS.items()}


def test_a_run_from_a_t5_folder_in_every_layout_and_its_export(pairs_data: Path, tmp_path: Path) -> None:
    from dist_trainer.testing import run_distributed
    from dist_trainer.train.trainer import Trainer
    from tests.helpers import assert_same_curves, curves, tiny_config

    torch.manual_seed(1)
    folder = tmp_path / "t5"
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=PAIRS_VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0))
    model.save_pretrained(folder, max_shard_size="40KB")
    cfg = tiny_config(pairs_data, tmp_path / "single", model={"preset": "tiny"},
                      data={"objective": "seq2seq", "seq_len": 32, "target_len": 24},
                      optim={"lr": 0.0, "min_lr": 0.0, "warmup_steps": 0},
                      train={"init_from": str(folder), "max_steps": 1, "eval_every": 1, "save_every": 1})
    trainer = Trainer(cfg, log=False)
    theirs = _reference(folder)
    losses = []
    for indices in trainer.sampler.micro_batches(0):
        batch = trainer._batch(trainer.train_data, indices, 0)
        with torch.no_grad():
            losses.append(theirs(input_ids=batch["tokens"], attention_mask=batch["source_mask"].long(),
                                 decoder_input_ids=batch["decoder_tokens"], labels=batch["targets"]).loss.item())
    single = curves(trainer.train())
    assert abs(single["losses"][0] - sum(losses) / len(losses)) <= 1e-5 * single["losses"][0], (single, losses)
    results = run_distributed(_layouts, 2, (pairs_data, tmp_path, folder))[0]
    for name in LAYOUTS:
        assert_same_curves(results[name], single, what=name)
    out = tmp_path / "export"
    export_checkpoint(tmp_path / "tp2sp", out, max_shard_size="40KB")
    want, got = _tensors(folder), _tensors(out)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    _, info = transformers.T5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
