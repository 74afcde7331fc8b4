"""Merged LoRA export, and runs that start from other weights (train.init_from) with new adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.config import ModelConfig
from dist_trainer.model import Transformer
from dist_trainer.model_lora import is_adapter
from dist_trainer.testing import run_distributed
from dist_trainer.train.export import export_safetensors
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, subprocess_env, tiny_config

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all_linear"}
TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def runs(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A plain run (5 steps) and a LoRA run (10 steps) on one process, with their last eval losses."""
    root = tmp_path_factory.mktemp("ft-export")
    base = Trainer(tiny_config(tiny_data, root / "base", train={"max_steps": 5}), log=False).train()
    lora = Trainer(tiny_config(tiny_data, root / "lora", model=LORA), log=False).train()
    (root / "final_eval.json").write_text(json.dumps({"base": base.eval_losses[5], "lora": lora.eval_losses[10]}))
    return {"root": root, "base": root / "base", "lora": root / "lora"}


def _plain_model(folder: Path) -> Transformer:
    cfg = ModelConfig(**json.loads((folder / "config.json").read_text()))
    model = Transformer(cfg)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.eval()


def test_merged_export_gives_the_adapted_models_logits(runs: dict[str, Path], tmp_path: Path) -> None:
    adapted, cfg = load_plain_model(runs["lora"])
    assert any(torch.count_nonzero(p) for n, p in adapted.named_parameters() if n.endswith("lora_B"))  # trained
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "dist_trainer.cli", "export", "--checkpoint", str(runs["lora"]),
                           "--out", str(out), "--format", "native", "--merge-lora"], env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    merged = _plain_model(out)
    assert merged.cfg.lora_rank == 0 and not any(is_adapter(k) for k in load_file(str(out / "model.safetensors")))
    with torch.no_grad():
        want, got = adapted(TOKENS), merged(TOKENS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the un-merged export keeps the adapters under their names, with the LoRA config
    export_safetensors(runs["lora"], tmp_path / "adapters")
    assert any(k.endswith("lora_A") for k in load_file(str(tmp_path / "adapters" / "model.safetensors")))
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        export_safetensors(runs["base"], tmp_path / "nothing", merge_lora=True)


def _start(data: Path, out: Path, init_from: Path, **sections: dict) -> dict:
    cfg = tiny_config(data, out, model={**LORA, **sections.pop("model", {})},
                      train={"max_steps": 5, "init_from": str(init_from)}, **sections)
    return curves(Trainer(cfg, log=False).train())


def test_a_lora_run_starts_from_a_plain_checkpoint_or_an_export(runs: dict[str, Path], tiny_data: Path,
                                                                   tmp_path: Path) -> None:
    """Step 0 computes the source model (B = 0): its eval loss is the source's own final eval loss."""
    final = json.loads((runs["root"] / "final_eval.json").read_text())
    started = _start(tiny_data, tmp_path / "from-base", runs["base"])
    assert started["eval"][0] == pytest.approx(final["base"], rel=1e-6)
    assert started["eval"][5] < started["eval"][0]  # the adapters learn
    model, _ = load_plain_model(tmp_path / "from-base")
    source, _ = load_plain_model(runs["base"])
    assert torch.equal(model.layers[0].attn.q_proj.weight, source.layers[0].attn.q_proj.weight)  # frozen base

    # a LoRA run's checkpoint (adapters merged into its base on read) and its merged export start the same
    export_safetensors(runs["lora"], tmp_path / "merged", merge_lora=True)
    for source_path in (runs["lora"], tmp_path / "merged"):
        again = _start(tiny_data, tmp_path / f"from-{source_path.name}", source_path)
        assert again["eval"][0] == pytest.approx(final["lora"], rel=1e-5), source_path


def _start_distributed(rank: int, world_size: int, data: Path, root: Path, init_from: Path) -> dict:
    return {name: _start(data, root / name, init_from, parallel=parallel)
            for name, parallel in (("zero3", {"zero_stage": 3}), ("pp2", {"pp_size": 2}),
                                   ("tp2", {"tp_size": 2}))}


def test_init_from_loads_by_name_in_every_regime(runs: dict[str, Path], tiny_data: Path, tmp_path: Path) -> None:
    """ZeRO-3 copies into its partitions one module at a time; pipeline stages take their own layers."""
    ref = _start(tiny_data, tmp_path / "single", runs["base"])
    got = run_distributed(_start_distributed, 2, (tiny_data, tmp_path, runs["base"]), env={"DS_ACCELERATOR": "cpu"})
    for name, result in got[0].items():
        assert_same_curves(result, ref, what=name)


def test_init_from_is_checked_before_any_process_starts(runs: dict[str, Path], tiny_data: Path,
                                                        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train.init_from=.*nowhere: neither a checkpoint"):
        _start(tiny_data, tmp_path / "a", tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"its model differs from this run's \(source, now\): \{'d_model': \(32, 64\)"):
        _start(tiny_data, tmp_path / "b", runs["base"], model={"d_model": 64})
