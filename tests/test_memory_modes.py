"""The memory modes through the Trainer in every regime: selective recomputation of the attention core (Korthikanti
et al. 2022, section 4.2), torchtitan's op-level policy, and the chunked head and loss (issue 37).

`parallel.activation_checkpointing=selective` recomputes each layer's attention core (RoPE, the GQA repeat,
SDPA) in backward; `op` runs every layer under a checkpoint that keeps its attention kernel's and every other
matmul's outputs (``model_recompute.py``). The model is pure torch, so every engine gets both through
``set_activation_checkpointing``; each run's training and eval losses must equal one process's run *without*
recomputation (10 steps, evaluation every 5, checkpoints on). ``model.loss_chunk_tokens`` projects and scores the
head's input a chunk of tokens at a time (``model_loss.py``), here in chunks that do not divide the micro-batch's
tokens (tests/test_chunked_loss.py checks ignored targets, the masked-LM head and the soft-cap on the model);
``parallel.activation_offload`` moves the first layers' saved tensors to host memory and back (``model_offload.py``).
The 2-rank runs of the last two go together: each layout chunks its loss and offloads half of its layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_trainer.testing import run_distributed
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, tiny_config

# Llama-style: GQA, RoPE and SwiGLU put the repeat and the rotation inside the recomputed core.
LLAMA = {"n_kv_heads": 2, "activation": "swiglu", "pos_embedding": "rope", "norm": "rmsnorm", "bias": False,
         "tie_embeddings": False}
DS_ENV = {"DS_ACCELERATOR": "cpu"}


CHUNK = {"loss_chunk_tokens": 48}  # micro-batches of 4 x 64 tokens (32 per cp rank)


def _curves(rank: int, world: int, data: Path, out: Path, parallel: dict, model: dict | None = None) -> dict:
    from dist_trainer.model_blocks import Attention
    from dist_trainer.model_loss import ChunkedLoss

    sections = {"model": {**LLAMA, **(model or {})}, "optim": {"lr": 3e-3}, "parallel": parallel}
    trainer = Trainer(tiny_config(data, out, **sections), log=False)
    engine = trainer.engine
    modules = [s.model for s in getattr(engine, "stages", [])] or [engine.model]
    cores = [m.recompute_core for module in modules for m in module.modules() if isinstance(m, Attention)]
    # op-level: every layer this rank holds runs under the policy's checkpoint
    models = [getattr(m, "model", m) for m in modules]  # a pipeline stage's split holds its part of the model
    ops = [m.recompute_ops and len(m.checkpointed) == len(m.layers) for m in models]
    chunked = [any(isinstance(x, ChunkedLoss) for x in m.modules()) for m in models if hasattr(m, "loss")]
    out = curves(trainer.train())
    # bytes went out and came back (a forward without backward, the pipeline's shape inference, sends some only out)
    moved = [m.offload.to_host_bytes > 0 and m.offload.to_device_bytes > 0 for m in models]
    return {**out, "recomputed_cores": cores, "recomputed_ops": ops, "chunked": chunked, "offloaded": moved}


@pytest.fixture(scope="module")
def reference(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, no recomputation."""
    return _curves(0, 1, tiny_data, tmp_path_factory.mktemp("reference"), {})


def _recomputes(run: dict, mode: str) -> bool:
    """Every layer of the run's model (each pipeline stage's) recomputes as ``mode`` asks."""
    flags = run["recomputed_cores"] if mode == "selective" else run["recomputed_ops"]
    return bool(flags) and all(flags)


@pytest.mark.parametrize("mode", ["selective", "op"])
def test_one_process(mode: str, reference: dict, tiny_data: Path, tmp_path: Path) -> None:
    got = _curves(0, 1, tiny_data, tmp_path, {"activation_checkpointing": mode})
    assert not _recomputes(reference, "selective") and not _recomputes(reference, "op")
    assert _recomputes(got, mode)
    assert reference["losses"][9] < reference["losses"][0]
    assert_same_curves(got, reference, what=f"{mode}, one process")


def test_one_process_chunked_loss(reference: dict, tiny_data: Path, tmp_path: Path) -> None:
    got = _curves(0, 1, tiny_data, tmp_path, {}, CHUNK)
    assert got["chunked"] == [True] and reference["chunked"] == [False]
    assert_same_curves(got, reference, what="chunked loss, one process")


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_one_process_offload(mode: str, reference: dict, tiny_data: Path, tmp_path: Path) -> None:
    got = _curves(0, 1, tiny_data, tmp_path, {"activation_offload": 1.0, "activation_checkpointing": mode})
    assert got["offloaded"] == [True] and reference["offloaded"] == [False]
    assert_same_curves(got, reference, what=f"offload, {mode}, one process")


TWO_RANKS = {f"{name}-{mode}": {**parallel, "activation_checkpointing": mode} for mode in ("selective", "op")
             for name, parallel in (("tp2-sp", {"tp_size": 2, "sequence_parallel": True}), ("pp2", {"pp_size": 2}),
                                    ("zero3", {"zero_stage": 3}))}
TWO_RANKS["cp2-op"] = {"cp_size": 2, "activation_checkpointing": "op"}
CHUNKED = {f"{name}-chunked-offload": {**parallel, "activation_offload": 0.5} for name, parallel in (
    ("tp2-sp", {"tp_size": 2, "sequence_parallel": True}), ("pp2", {"pp_size": 2}), ("cp2", {"cp_size": 2}),
    ("zero3", {"zero_stage": 3}))}


def _layouts(rank: int, world: int, data: Path, root: Path) -> dict[str, dict]:
    """Each 2-rank layout with its recomputation or chunked loss, one after the other in one spawn."""
    runs = {name: _curves(rank, world, data, root / name, parallel) for name, parallel in TWO_RANKS.items()}
    return runs | {name: _curves(rank, world, data, root / name, parallel, CHUNK) for name, parallel in CHUNKED.items()}


@pytest.fixture(scope="module")
def two_ranks(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_distributed(_layouts, 2, (tiny_data, tmp_path_factory.mktemp("two")), env=DS_ENV, timeout=600)


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks(name: str, reference: dict, two_ranks: list[dict[str, dict]]) -> None:
    runs = [rank[name] for rank in two_ranks]
    assert all(_recomputes(run, TWO_RANKS[name]["activation_checkpointing"]) for run in runs)  # this rank's layers
    assert_same_curves(runs[-1], reference, what=name)  # the last rank: the pipeline's loss


@pytest.mark.parametrize("name", list(CHUNKED))
def test_two_ranks_chunked_loss_and_offload(name: str, reference: dict, two_ranks: list[dict[str, dict]]) -> None:
    runs = [rank[name] for rank in two_ranks]
    assert any(flag for run in runs for flag in run["chunked"])  # the rank(s) holding the loss
    assert all(all(run["offloaded"]) for run in runs)  # every rank's first layer went to the host and back
    assert_same_curves(runs[-1], reference, what=name)
