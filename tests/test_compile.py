"""``train.compile``: every regime's compiled run has the single process's eager losses (issue 26).

Each regime trains a 4-layer tiny model 10 steps in fp32 with its blocks and loss head compiled (inductor, on the
CPU), evaluation and checkpoints on, and must give the training and evaluation losses of one eager process within
1e-5. The cases cover DDP, TP with and without SP, the GPipe, 1F1B and interleaved schedules, ZeRO-1 (over TP and
over pipeline stages), ZeRO-2, expert parallelism, LoRA, and selective and full recomputation; they run one after
the other in one spawn of 2 gloo ranks, and the compile cache (``TORCHINDUCTOR_CACHE_DIR``, ``.torchinductor/`` in
the project, set in conftest.py) lets a repeated run of the suite skip inductor's code generation. The two layouts
that do not take compilation are refused before launch, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_trainer.config import ModelConfig
from dist_trainer.layout_rules import COMPILE_REFUSED
from dist_trainer.model import build_model
from dist_trainer.parallel.compile import apply_compile, compile_targets, is_compiled
from dist_trainer.testing import run_distributed
from dist_trainer.train.check import check_run
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, tiny_config

LAYERS = {"n_layers": 4}  # 4 stages for pp=2 x 2 virtual stages
LORA = {**LAYERS, "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all_linear"}
MOE = {**LAYERS, "n_kv_heads": 2, "activation": "swiglu", "pos_embedding": "rope", "norm": "rmsnorm", "bias": False,
       "tie_embeddings": False, "n_experts": 4, "top_k": 2, "capacity_factor": 1.0, "router_aux_loss": 0.1,
       "router_z_loss": 0.01}
REFERENCES = {"dense": LAYERS, "lora": LORA, "moe": MOE}
TP_SP = {"tp_size": 2, "sequence_parallel": True}
CASES = {  # name: (reference model, parallel section); every regime and recompute mode at least once, in few runs
    "ddp-full-recompute": ("dense", {"activation_checkpointing": "full"}),
    "pp2-gpipe": ("dense", {"pp_size": 2, "pp_schedule": "gpipe"}),
    "pp2-1f1b-zero1-full-recompute": ("dense", {"pp_size": 2, "zero_stage": 1, "activation_checkpointing": "full"}),
    "pp2-interleaved": ("dense", {"pp_size": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2,
                                  "micro_batch_size": 2}),
    "zero1-tp2": ("dense", {"zero_stage": 1, "tp_size": 2}),
    "zero2": ("dense", {"zero_stage": 2}),
    "ep2": ("moe", {"ep_size": 2}),
    "lora-tp2-sp-selective": ("lora", {**TP_SP, "activation_checkpointing": "selective"}),
}
COUNTED = "lora-tp2-sp-selective"  # also run eagerly in the spawn: its collectives are compared step by step


def _config(data: Path, out: Path, model: dict, parallel: dict, compiled: bool):  # noqa: ANN202 - a Config
    return tiny_config(data, out, model=model, parallel=parallel, train={"compile": compiled})


def _comm_bytes(out: Path) -> dict[int, dict[str, int]]:
    """Bytes per (axis, collective) of each training step, from rank 0's metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("comm_bytes/")} for r in records if "loss" in r}


def _run_cases(rank: int, world_size: int, data: Path, root: Path) -> dict:
    out: dict = {}
    for name, (ref, parallel) in CASES.items():
        out[name] = curves(Trainer(_config(data, root / name, REFERENCES[ref], parallel, compiled=True)).train())
    ref, parallel = CASES[COUNTED]
    Trainer(_config(data, root / "eager", REFERENCES[ref], parallel, compiled=False)).train()
    if rank == 0:
        out["comm"] = {"compiled": _comm_bytes(root / COUNTED), "eager": _comm_bytes(root / "eager")}
    return out


@pytest.fixture(scope="module")
def runs(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("compile")
    refs = {ref: curves(Trainer(_config(tiny_data, root / ref, model, {}, compiled=False), log=False).train())
            for ref, model in REFERENCES.items()}
    got = run_distributed(_run_cases, 2, (tiny_data, root), timeout=1200)
    assert all(got[1][name] == got[0][name] for name in CASES)  # every rank reports the same losses
    return refs, got[0]


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_losses_equal_the_eager_single_process(runs: tuple[dict, dict], name: str) -> None:
    refs, got = runs
    assert_same_curves(got[name], refs[CASES[name][0]], what=name)


def test_compiled_blocks_run_the_same_counted_collectives(runs: tuple[dict, dict]) -> None:
    """The collectives stay eager and counted inside a compiled block (TP's f/g and SP's gather/scatter pairs):
    the bytes per axis and collective at every step equal the eager run's."""
    comm = runs[1]["comm"]
    assert comm["eager"] and any(k.startswith("comm_bytes/tp/") for k in comm["eager"][1]), comm["eager"]
    assert comm["compiled"] == comm["eager"]


def test_apply_compile_compiles_every_block_and_the_head_in_place() -> None:
    bert = ModelConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2, max_seq_len=8, norm_placement="post",
                       mlm_head=True, causal=False)
    model = build_model(bert, seed=0)
    names_before = [n for n, _ in model.named_parameters()]
    assert apply_compile(model) == ["layers.0", "layers.1", "layers.2", "mlm_transform", "loss"]
    assert all(is_compiled(module) for _, module in compile_targets(model))
    assert not is_compiled(model) and not is_compiled(model.tok_emb)
    assert [n for n, _ in model.named_parameters()] == names_before  # checkpoints and the TP plan see one model


@pytest.mark.parametrize(("parallel", "key"), [({"zero_stage": 3}, "zero_stage=3"),
                                               ({"pp_size": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2,
                                                 "micro_batch_size": 2}, "pp_schedule=zero_bubble")])
def test_layouts_that_cannot_compile_are_refused_before_launch(parallel: dict, key: str, tiny_data: Path,
                                                                tmp_path: Path) -> None:
    check_run(_config(tiny_data, tmp_path, LAYERS, parallel, compiled=False), 2, None, "cpu")  # runs eagerly
    with pytest.raises(ValueError) as refused:
        check_run(_config(tiny_data, tmp_path, LAYERS, parallel, compiled=True), 2, None, "cpu")
    assert str(refused.value).startswith(f"train.compile=true with parallel.{key} is not supported: "
                                         f"{COMPILE_REFUSED[key]}. Use "), refused.value


def test_compiled_blocks_keep_packed_documents_apart() -> None:
    """data.document_masking under train.compile: a compiled model's loss and gradients on a packed batch (three
    documents per row, RoPE restarting in each) equal the eager model's, which differ from the unmasked ones."""
    import torch

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, dropout=0.0,
                      pos_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False)
    eager, compiled = build_model(cfg, seed=0), build_model(cfg, seed=0)
    apply_compile(compiled)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 24), generator=gen)
    targets = torch.randint(0, 64, (2, 24), generator=gen)
    documents = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 9 + [1] * 3 + [2] * 12])
    losses, grads = [], []
    for model in (eager, compiled):
        model.zero_grad()
        loss = model(tokens, targets, documents=documents)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        unmasked = eager(tokens, targets)
    assert abs(unmasked.item() - losses[0].item()) > 1e-4  # the masking changes the loss: the check can fail
