"""LoRA and frozen parameters in every regime: the single-process losses, frozen weights untouched, exact resume.

Issue 14's done-when: tp=2 with SP, pp=2, ZeRO-2, ZeRO-3 and dp=2 on 2 gloo ranks, 10 steps in fp32, training and
evaluation losses within 1e-5 of one process; the frozen weights bit-identical to the seed's draw after training
(read back from each run's final checkpoint, consolidated by name); no optimizer state for them; a resume from the
step-5 checkpoint continues with the same losses. All cases of a regime family run in one spawn.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.convert import read_full_state
from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.facts.finetune import frozen_modules
from dist_trainer.model import build_model
from dist_trainer.model_lora import freeze_, is_adapter
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, relative_diff, tiny_config

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all_linear"}
# Llama-style with one kv head: at tp=2 the k/v projections (and their adapters) are replicated on both ranks
LLAMA_KV1 = {"n_kv_heads": 1, "d_ff": 88, "pos_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu",
             "bias": False, "tie_embeddings": False}
REFERENCES = {
    "lora": {"model": LORA},
    "lora-llama": {"model": {**LLAMA_KV1, **LORA}},
    # the tied embedding (both pipeline copies), one layer's attention and every MLP norm
    "freeze": {"train": {"freeze": ["embeddings", "layers.0.attn", "*.mlp_norm"]}},
    "bottom": {"train": {"freeze": ["bottom:1"]}},  # with pp=2 the whole first stage is frozen
}
TP_SP = {"tp_size": 2, "sequence_parallel": True}
CASES = {  # name: (reference, parallel section)
    "lora-tp2-sp": ("lora", TP_SP), "lora-llama-tp2-sp": ("lora-llama", TP_SP), "lora-pp2": ("lora", {"pp_size": 2}),
    "lora-zero2": ("lora", {"zero_stage": 2}), "lora-zero3": ("lora", {"zero_stage": 3}), "lora-dp2": ("lora", {}),
    "freeze-tp2-sp": ("freeze", TP_SP), "freeze-pp2": ("freeze", {"pp_size": 2}),
    "freeze-zero2": ("freeze", {"zero_stage": 2}), "freeze-zero3": ("freeze", {"zero_stage": 3}),
    "freeze-dp2": ("freeze", {}), "bottom-pp2": ("bottom", {"pp_size": 2}),
}
RESUMED = ("lora-tp2-sp", "lora-pp2", "lora-zero3", "freeze-zero2", "freeze-dp2", "bottom-pp2")
DS_ENV = {"DS_ACCELERATOR": "cpu"}


def sections(name: str, **train: object) -> dict:
    ref, parallel = CASES[name] if name in CASES else (name, {})
    base = REFERENCES[ref]
    return {**base, "parallel": parallel, "train": {**base.get("train", {}), **train}}


def _run_cases(rank: int, world_size: int, data: Path, root: Path, names: list[str]) -> dict:
    """Every case on these ranks; then, for the RESUMED ones, a resume from a copy of the step-5 checkpoint."""
    out: dict = {}
    for name in names:
        out[name] = curves(Trainer(tiny_config(data, root / name, **sections(name)), log=False).train())
        if name not in RESUMED:
            continue
        if rank == 0:
            step5 = root / name / "checkpoints" / "step_00000005"
            shutil.copytree(step5, root / f"{name}-resumed" / "checkpoints" / step5.name)
        dist.barrier()
        cfg = tiny_config(data, root / f"{name}-resumed", **sections(name, resume=True))
        out[f"{name}-resumed"] = Trainer(cfg, log=False).train().losses
    return out


@pytest.fixture(scope="module")
def runs(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("finetune")
    refs = {ref: curves(Trainer(tiny_config(tiny_data, root / ref, **sections(ref)), log=False).train())
            for ref in REFERENCES}
    got = run_distributed(_run_cases, 2, (tiny_data, root, list(CASES)), env=DS_ENV)
    assert got[0] == got[1]  # both ranks report the same losses
    return root, refs, got[0]


@pytest.mark.parametrize("name", list(CASES))
def test_losses_equal_the_single_process_run(runs: tuple[Path, dict, dict], name: str) -> None:
    _, refs, got = runs
    ref = refs[CASES[name][0]]
    assert ref["losses"][9] < ref["losses"][0]  # something trains
    assert_same_curves(got[name], ref, what=name)


@pytest.mark.parametrize("name", list(CASES))
def test_frozen_weights_are_the_seeds_draw_and_have_no_optimizer_state(runs: tuple[Path, dict, dict],
                                                                       name: str) -> None:
    root = runs[0]
    step = ckpt.latest_checkpoint(root / name / "checkpoints")
    assert step is not None and step.name == "step_00000010"
    model, cfg = load_plain_model(step)  # any layout merged by name; ZeRO consolidated to fp32
    start = build_model(cfg.model, seed=cfg.train.seed)
    freeze_(start, frozen_modules(cfg.model, cfg.train.freeze))
    before, after = start.state_dict(), model.state_dict()
    frozen = {n for n, p in start.named_parameters() if not p.requires_grad}
    trainable = {n for n, p in start.named_parameters() if p.requires_grad}
    assert frozen and trainable
    for n in frozen:
        assert torch.equal(after[n], before[n]), (name, n)
    assert all(not torch.equal(after[n], before[n]) for n in trainable if not n.endswith("lora_A")), name
    if cfg.model.lora_rank:
        assert frozen == {n for n in before if not is_adapter(n)}
    _, optim = read_full_state(step, ckpt.read_meta(step))
    assert set(optim["state"]) == trainable, name  # AdamW moments for the trainable parameters only


@pytest.mark.parametrize("name", RESUMED)
def test_resume_from_step_5_is_exact(runs: tuple[Path, dict, dict], name: str) -> None:
    _, _, got = runs
    resumed, full = got[f"{name}-resumed"], got[name]["losses"]
    assert sorted(resumed) == [5, 6, 7, 8, 9]
    assert all(resumed[s] == full[s] for s in resumed), (name, resumed, full)


def test_lora_checkpoint_of_tp2_resumes_in_one_process(runs: tuple[Path, dict, dict], tiny_data: Path) -> None:
    """The adapters' TP shards (A whole or split, B split or whole) reshard by name like the weights."""
    root, _, got = runs
    target = root / "lora-tp2-to-1"
    shutil.copytree(root / "lora-tp2-sp" / "checkpoints" / "step_00000005", target / "checkpoints" / "step_00000005")
    resumed = Trainer(tiny_config(tiny_data, target, **sections("lora", resume=True)), log=False).train().losses
    steps = [5, 6, 7, 8, 9]
    assert relative_diff([resumed[s] for s in steps], [got["lora-tp2-sp"]["losses"][s] for s in steps]) <= 1e-5
