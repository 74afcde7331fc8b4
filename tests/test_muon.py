"""Muon (issue 38): one step against a reference written here from the papers, and the distributed layouts against
one process.

The reference is independent of ``optim_muon.py``: Keller Jordan's Newton-Schulz quintic with its published
coefficients, Moonshot's update-RMS scaling and Nesterov momentum written out, torch's own AdamW for the
parameters Muon leaves to it. The layouts (dp=2, tp=2 with sequence parallelism, pp=2, DeepSpeed's ZeRO-1, ZeRO-2 and
ZeRO-3 at dp=2, ZeRO-3's flats cut into several sub groups, and ep=2 for a MoE model)
train 6 steps in one 2-rank spawn and must reproduce one process's training and eval losses within 1e-5; a tp=2
checkpoint resumes at dp=2, under ZeRO-3 and on one process, a pp=2 one under ZeRO-1, ZeRO-2 and ZeRO-3 ones on one
process, the ZeRO-3 one also from its own files (the same layout); a resume under another ``optim.name`` is refused
naming both.
The sgd entry runs under DeepSpeed's ZeRO-1 in the same spawn (one process's losses; its checkpoint resumed on one
process). Fine-tunes (``train.freeze`` of a layer, LoRA) own the optimizer bytes the planner says on every rank: a
frozen hidden matrix holds no Muon momentum.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_trainer.checkpoint.deepspeed_files import load_deepspeed_file, model_file
from dist_trainer.config import OptimConfig
from dist_trainer.config_model import ModelConfig
from dist_trainer.experiments.memory_experiment import experiment_config, measure_rank, predictions
from dist_trainer.model import Transformer
from dist_trainer.optim import build_optimizer
from dist_trainer.parallel.zero.config import default_ds_config_path
from dist_trainer.planner.cost import estimate_step_time
from dist_trainer.planner.hardware import get_hardware
from dist_trainer.planner.memory import Layout, TrainingOptions
from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import STEP3, assert_same_curves, curves, relative_diff, share_checkpoint, tiny_config

MOE = {"n_kv_heads": 2, "activation": "swiglu", "pos_embedding": "rope", "norm": "rmsnorm", "bias": False,
       "tie_embeddings": False, "n_experts": 4, "top_k": 2, "capacity_factor": 2.0}
DENSE = {"activation": "swiglu", "norm": "rmsnorm", "n_kv_heads": 2, "tie_embeddings": False}


def _reference_ns(g: torch.Tensor) -> torch.Tensor:
    """Jordan et al. 2024's zeropower_via_newtonschulz5 (in fp32 here, as ours runs; the published one in bf16)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    if g.shape[0] > g.shape[1]:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _hidden(name: str, p: torch.Tensor) -> bool:
    """What the issue lists for Muon: the 2-D attention and MLP weights (not embeddings, head, norms, routers)."""
    return p.ndim == 2 and any(f"{m}.weight" in name for m in ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                                "gate_proj", "down_proj"))


def test_muon_steps_match_a_reference_written_from_the_papers() -> None:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.0, **MOE)
    torch.manual_seed(0)
    model = Transformer(cfg)
    reference = Transformer(cfg)
    reference.load_state_dict(model.state_dict())
    o = OptimConfig(name="muon", lr=0.02, weight_decay=0.1, momentum=0.95, beta1=0.9, beta2=0.95)
    ours = build_optimizer(model, o)
    named = dict(reference.named_parameters())
    muon = {n for n, p in named.items() if _hidden(n, p)}
    assert any("experts.0.up_proj" in n for n in muon) and not any("router" in n or "emb" in n for n in muon)
    adam_decay = [p for n, p in named.items() if n not in muon and p.ndim == 2 and not n.endswith("_emb.weight")]
    adam_rest = [p for n, p in named.items() if n not in muon and not (p.ndim == 2 and not n.endswith("_emb.weight"))]
    adamw = torch.optim.AdamW([{"params": adam_decay, "weight_decay": o.weight_decay},
                               {"params": adam_rest, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2),
                              eps=o.eps, foreach=False)
    momentum = {n: torch.zeros_like(named[n]) for n in muon}
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(3):  # fp32 round-off in one step (1e-7) grows through the next forwards: compared at 1e-5
        for m in (model, reference):
            m.zero_grad()
            m(tokens, tokens).backward()
        ours.step()
        adamw.step()
        with torch.no_grad():
            for n in muon:
                p = named[n]
                momentum[n] = 0.95 * momentum[n] + p.grad
                update = _reference_ns(p.grad + 0.95 * momentum[n]) * 0.2 * math.sqrt(max(p.shape))
                p.mul_(1 - o.lr * o.weight_decay).sub_(o.lr * update)
        for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert set(ours.state_dict()["state"][0]) == {"momentum_buffer"}  # the first group is Muon's


# ---------------------------------------------------------------- layouts against one process

def _config(data: Path, out: Path, model: dict, parallel: dict, optim: str = "muon", **train: Any) -> Any:
    return tiny_config(data, out, model=model, optim={"name": optim, "lr": 1e-2, "momentum": 0.95},
                       parallel={"global_batch_size": 8, **parallel},
                       train={"max_steps": 6, "eval_every": 6, "save_every": 3, **train})


DENSE_CASES = {"dp2": {}, "tp2_sp": {"tp_size": 2, "dp_size": 1, "sequence_parallel": True},
               "pp2": {"pp_size": 2, "dp_size": 1, "pp_schedule": "1f1b", "micro_batch_size": 2},
               "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}}
# and "zero3": ZeRO-3 in sub groups of about 3000 partition elements (DeepSpeed's sub_group_size): Muon's matrices
# lie in several flats, each stepped in a call of its own, and the checkpoint holds several flat groups per group
ZERO3_SUB_GROUPS = "ds_zero3_sub_groups.json"
MOE_CASES = {"ep2": {"ep_size": 2}}
FINETUNE = {"vocab_size": 512, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, **DENSE}
# (ZeRO stage, model fields, train.freeze): a frozen layer under DDP and ZeRO-3, LoRA's frozen base under ZeRO-3
FINETUNE_CASES = {"freeze_ddp": (0, {}, ("layers.0",)), "freeze_zero3": (3, {}, ("layers.0",)),
                  "lora_zero3": (3, {"lora_rank": 4}, ())}


def _finetune_config(name: str) -> Any:
    stage, model, freeze = FINETUNE_CASES[name]
    return experiment_config({**FINETUNE, **model}, stage, 2, optimizer="muon", freeze=freeze)


def _zero3_fragments(trainer: Trainer) -> list[tuple[str, int]]:
    """Every matrix of every flat DeepSpeed's ZeRO-3 hands Muon, with this rank's fragment as ``Muon.fragments``
    places it, checked against the whole matrix gathered by DeepSpeed: (name, elements of this rank's fragment)."""
    import deepspeed

    ds = trainer.engine.optimizer  # DeepSpeed's stage-3 optimizer, Muon inside
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out = []
    for i, (flat, params) in enumerate(zip(ds.fp32_partitioned_groups_flat, ds.fp16_groups, strict=True)):
        group = ds.optimizer.param_groups[ds.sub_group_to_group_id[i]]
        for p, (shape, fragment) in zip(params, ds.optimizer.fragments(flat, group), strict=True):
            with deepspeed.zero.GatheredParameters([p]):
                whole = p.detach().reshape(-1).float().clone()
            assert math.prod(shape) == whole.numel(), (names[id(p)], shape)
            if fragment is not None:
                torch.testing.assert_close(flat.narrow(0, fragment.flat, fragment.numel),
                                           whole.narrow(0, fragment.matrix, fragment.numel), rtol=0, atol=0)
            out.append((names[id(p)], 0 if fragment is None else fragment.numel))
    return out


def _two_ranks(rank: int, world: int, data: Path, root: Path) -> dict[str, Any]:
    """Each layout in turn; then the tp=2 run's step-3 checkpoint resumed at dp=2 (and, in the test, on one
    process)."""
    out: dict[str, Any] = {}
    zero3 = {"zero_stage": 3, "ds_config": str(root / ZERO3_SUB_GROUPS)}
    for name, parallel in {**DENSE_CASES, "zero3": zero3}.items():
        trainer = Trainer(_config(data, root / name, DENSE, parallel))
        out[name] = curves(trainer.train())
        if name == "zero3":
            out["zero3_fragments"] = _zero3_fragments(trainer)
    for name, parallel in MOE_CASES.items():
        out[name] = curves(Trainer(_config(data, root / name, MOE, parallel)).train())
    share_checkpoint(rank, root / "tp2_sp", [root / "resume_dp2", root / "resume_zero3"])
    out["resume_dp2"] = curves(Trainer(_config(data, root / "resume_dp2", DENSE, {}, resume=True)).train())
    # by name into DeepSpeed's ZeRO-3 partitions: Muon's momentum in its group's flats, AdamW's moments in the others
    out["resume_zero3"] = curves(Trainer(_config(data, root / "resume_zero3", DENSE, zero3, resume=True)).train())
    share_checkpoint(rank, root / "zero3", [root / "resume_zero3_native"])  # DeepSpeed's own partitions, as saved
    out["resume_zero3_native"] = curves(Trainer(_config(data, root / "resume_zero3_native", DENSE, zero3,
                                                        resume=True)).train())
    share_checkpoint(rank, root / "pp2", [root / "resume_zero1"])  # by name into DeepSpeed's partitions
    out["resume_zero1"] = curves(Trainer(_config(data, root / "resume_zero1", DENSE, {"zero_stage": 1},
                                                 resume=True)).train())
    # SGD's momentum in DeepSpeed's ZeRO-1 files (consolidated by the state names saved), resumed in the test
    out["sgd_zero1"] = curves(Trainer(_config(data, root / "sgd_zero1", DENSE, {"zero_stage": 1}, optim="sgd")).train())
    out["owned"] = {name: measure_rank(rank, world, _finetune_config(name).to_dict()) for name in FINETUNE_CASES}
    return out


@pytest.fixture(scope="module")
def runs(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("muon")
    ds = json.loads(default_ds_config_path(3, False).read_text())
    ds["zero_optimization"]["sub_group_size"] = 3000
    (root / ZERO3_SUB_GROUPS).write_text(json.dumps(ds))
    ranks = run_distributed(_two_ranks, 2, (tiny_data, root), timeout=600)
    two = {**ranks[0], **{k: [r[k] for r in ranks] for k in ("owned", "zero3_fragments")}}
    single = {"dense": curves(Trainer(_config(tiny_data, root / "single", DENSE, {})).train()),
              "moe": curves(Trainer(_config(tiny_data, root / "single_moe", MOE, {})).train()),
              "sgd": curves(Trainer(_config(tiny_data, root / "single_sgd", DENSE, {}, optim="sgd")).train())}
    return {"root": root, "two": two, "single": single}


def test_muon_layouts_match_one_process(runs: dict[str, Any]) -> None:
    for name in [*DENSE_CASES, "zero3"]:
        assert_same_curves(runs["two"][name], runs["single"]["dense"], what=name)
    for name in MOE_CASES:
        assert_same_curves(runs["two"][name], runs["single"]["moe"], what=name)


def test_muon_zero3_fragments_are_the_matrices_elements(tiny_data: Path, runs: dict[str, Any]) -> None:
    """After training, each rank's ZeRO-3 flats hold, where ``Muon.fragments`` says, the elements of the whole
    matrices (checked in the spawn); between them the two ranks hold every element of every matrix once."""
    ranks = runs["two"]["zero3_fragments"]
    names = [n for n, _ in ranks[0]]
    assert names == [n for n, _ in ranks[1]] and sum(n.endswith("mlp.up_proj.weight") for n in names) == 2
    model = Transformer(_config(tiny_data, runs["root"] / "plan", DENSE, {}).model)
    whole = {n: p.numel() for n, p in model.named_parameters()}
    assert {n: a + b for (n, a), (_, b) in zip(*ranks, strict=True)} == {n: whole[n] for n in names}


def test_muon_checkpoint_resumes_across_layouts(tiny_data: Path, runs: dict[str, Any]) -> None:
    root, reference = runs["root"], runs["single"]["dense"]
    ds_dir = root / "zero3" / STEP3 / "deepspeed"
    assert len(load_deepspeed_file(model_file(ds_dir, 0, 3))["param_shapes"]) > 4  # flat groups: the sub groups
    resumed = {name: runs["two"][name] for name in ("resume_dp2", "resume_zero1", "resume_zero3",
                                                    "resume_zero3_native")}
    for source in ("tp2_sp", "zero2", "zero3"):  # a TP checkpoint and DeepSpeed's ZeRO-2/3 files, each on one process
        shutil.copytree(root / source / STEP3, root / f"{source}_on_one" / STEP3)
        resumed[f"{source}_on_one"] = curves(Trainer(_config(tiny_data, root / f"{source}_on_one", DENSE, {},
                                                             resume=True)).train())
    for name, got in resumed.items():
        steps = [3, 4, 5]  # the steps after the checkpoint (losses are keyed from 0)
        assert relative_diff([got["losses"][s] for s in steps], [reference["losses"][s] for s in steps]) <= 1e-5, name
        assert relative_diff([got["eval"][6]], [reference["eval"][6]]) <= 1e-5, name


def test_sgd_under_zero1_matches_one_process_and_resumes_on_one(tiny_data: Path, runs: dict[str, Any]) -> None:
    """The sgd entry through DeepSpeed's client optimizer and its checkpoint files (momentum_buffer by name)."""
    root, reference = runs["root"], runs["single"]["sgd"]
    assert_same_curves(runs["two"]["sgd_zero1"], reference, what="sgd zero1")
    shutil.copytree(root / "sgd_zero1" / STEP3, root / "sgd_resume_one" / STEP3)
    got = curves(Trainer(_config(tiny_data, root / "sgd_resume_one", DENSE, {}, optim="sgd", resume=True)).train())
    steps = [3, 4, 5]
    assert relative_diff([got["losses"][s] for s in steps], [reference["losses"][s] for s in steps]) <= 1e-5
    assert relative_diff([got["eval"][6]], [reference["eval"][6]]) <= 1e-5


def test_muon_zero_owners_traffic_is_what_the_planner_prices(tiny_data: Path, runs: dict[str, Any]) -> None:
    """Under ZeRO-1/2/3 each step hands every matrix to its owner and back, a reduce and a broadcast on dp, as the
    runs' own ``AxisGroup`` counted them each step (metrics.jsonl): the bytes of the planner's ``optimizer`` term."""
    for stage in (1, 2, 3):
        cfg = _config(tiny_data, runs["root"] / "plan", DENSE, {"zero_stage": stage})
        layout = Layout(dp_size=2, zero_stage=stage, micro_batch_size=cfg.parallel.micro_batch_size)
        planned = estimate_step_time(cfg.model, layout, seq_len=cfg.data.seq_len, hardware=get_hardware("cpu"),
                                     gpus_per_node=2, options=TrainingOptions(optimizer="muon", precision="fp32",
                                                                              device="cpu")).axes["optimizer"]
        records = [json.loads(line) for line in (runs["root"] / f"zero{stage}" / "metrics.jsonl").open()]
        counted = [r["comm_bytes/dp/reduce"] + r["comm_bytes/dp/broadcast"] for r in records if "loss" in r]
        assert counted == [planned.bytes] * 6, (stage, counted, planned)


def test_muon_fine_tunes_own_the_optimizer_bytes_the_planner_says(runs: dict[str, Any]) -> None:
    """DeepSpeed's fp32 master and AdamW's moments on the trainable parameters Muon leaves, Muon's momentum on the
    hidden matrices that train (none of layer 0's when it is frozen, none under LoRA): to the byte on each rank."""
    for name in FINETUNE_CASES:
        planned = predictions(_finetune_config(name), 2)["planner"]["optimizer"]
        assert [r[name]["optimizer"] for r in runs["two"]["owned"]] == [planned] * 2, name


def test_switching_optimizer_on_resume_is_refused(tiny_data: Path, runs: dict[str, Any]) -> None:
    root = runs["root"]
    shutil.copytree(root / "tp2_sp" / STEP3, root / "switch" / STEP3)
    with pytest.raises(ValueError, match="optim.name=muon.*optim.name=adamw"):
        Trainer(_config(tiny_data, root / "switch", DENSE, {}, optim="adamw", resume=True))


def test_muon_under_zero_beside_tp_or_offload_is_refused(tiny_data: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="optim.name=muon under parallel.zero_stage=3 runs with tp_size, pp_size, "
                                         "ep_size 1 and no zero_offload, not tp_size=1, pp_size=1, ep_size=1, "
                                         "zero_offload=True"):
        _config(tiny_data, tmp_path, DENSE, {"zero_stage": 3, "zero_offload": True})
    with pytest.raises(ValueError, match="optim.name=muon under parallel.zero_stage=1 runs with tp_size, pp_size, "
                                         "ep_size 1 and no zero_offload, not tp_size=2"):
        _config(tiny_data, tmp_path, DENSE, {"zero_stage": 1, "tp_size": 2, "dp_size": 1})
