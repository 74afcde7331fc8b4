"""``export --quantize int8`` (native and Hugging Face folders) and ``dist-trainer eval`` (issue 25).

One short run per model family; its checkpoint is exported in fp32 and in int8, and the int8 folders are read back
through the paths users take (``eval``, ``generate``, the HF import path ``open_source``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.cli import main
from dist_trainer.train.evaluate import evaluate
from dist_trainer.train.export import export_checkpoint
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config

LLAMA = {"n_kv_heads": 2, "pos_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
         "tie_embeddings": False}


MOE = {**LLAMA, "n_experts": 4, "top_k": 2}  # dropless, every layer MoE: Mixtral's family on export
# a linear whose int8 codes the test checks, per family: an MLP's, or an expert's (the bulk of a MoE model)
DOWN = {"gpt2": "layers.1.mlp.down_proj.weight", "llama": "layers.1.mlp.down_proj.weight",
        "moe": "layers.1.moe.experts.3.down_proj.weight"}


@pytest.fixture(scope="module", params=["gpt2", "llama", "moe"])
def run(request: pytest.FixtureRequest, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[Path, float, Path]:
    """(run folder, the eval loss it logged at its last step, a folder for exports)."""
    out = tmp_path_factory.mktemp(request.param)
    model = {"gpt2": {}, "llama": LLAMA, "moe": MOE}[request.param]
    cfg = tiny_config(tiny_data, out / "run", model=model, train={"max_steps": 5})
    result = Trainer(cfg, log=False).train()
    return out / "run", result.eval_losses[5], out


def test_eval_reports_the_loss_the_run_logged(run: tuple[Path, float, Path]) -> None:
    folder, logged, _ = run
    rows = json.loads(evaluate([str(folder)], {}, as_json=True))["rows"]
    assert abs(rows[0]["eval_loss"] - logged) <= 1e-6 * logged, (rows, logged)


def test_int8_exports_read_back_everywhere_within_their_quantisation(run: tuple[Path, float, Path],
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     request: pytest.FixtureRequest) -> None:
    """Native and HF int8 exports: int8 codes with one fp32 scale per output channel for every layer linear (per
    column of GPT-2's transposed Conv1D), about a quarter of the fp32 bytes for those; both read back as the same
    fp32 model (HF's q/k row order and fused c_attn undone with the scales); eval loss within 1% of fp32's."""
    folder, _, out = run
    down = DOWN[request.node.callspec.params["run"]]
    native, hf, hf32 = out / "native8", out / "hf8", out / "hf32"
    export_checkpoint(folder, native, "native", quantize="int8")
    export_checkpoint(folder, hf, "hf", quantize="int8")
    export_checkpoint(folder, hf32, "hf")
    with safe_open(str(native / "model.safetensors"), "pt") as f:
        for name in ("layers.0.attn.q_proj.weight", down):
            q, s = f.get_tensor(name), f.get_tensor(f"{name}_scale")
            assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (q.shape[0], 1), name
        assert f.get_tensor("tok_emb.weight").dtype == torch.float32
    config = json.loads((hf / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "dist_trainer_int8"
    ours, theirs = (load_plain_model(p)[0].state_dict() for p in (native, hf))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    fp32 = load_plain_model(folder)[0].state_dict()
    w = fp32[down]
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((ours[down] - w).abs() <= step / 2 + 1e-7) and not torch.equal(ours[down], w)
    assert (hf / "model.safetensors").stat().st_size < 0.75 * (hf32 / "model.safetensors").stat().st_size
    rows = json.loads(evaluate([str(folder), str(native), str(hf)], {}, as_json=True))["rows"]
    assert abs(rows[1]["over_first"] - 1) < 0.01 and rows[1]["eval_loss"] == rows[2]["eval_loss"], rows
    assert main(["generate", "--checkpoint", str(hf), "--prompt-ids", "1,2,3", "--greedy", "--max-new-tokens", "3",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 3  # the new tokens


def test_export_refusals(run: tuple[Path, float, Path], tmp_path: Path) -> None:
    folder, _, _ = run
    with pytest.raises(ValueError, match="--quantize='int4' is not one of int8"):
        export_checkpoint(folder, tmp_path / "a", "native", quantize="int4")
    with pytest.raises(ValueError, match="--adapter writes the adapters alone"):
        export_checkpoint(folder, tmp_path / "b", "hf", quantize="int8", adapter=True)
    with pytest.raises(ValueError, match="give --data"):
        evaluate([str(tmp_path / "nothing-here.safetensors")], {})
