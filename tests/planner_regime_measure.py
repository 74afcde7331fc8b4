"""Measure what a tensor-parallel or pipeline rank of the real Trainer holds, for checking the planner.

Per rank and layout (run inside ``run_distributed``):

- model states: the bytes of this rank's parameters, their gradients (read after a backward, before the
  optimizer step's ``zero_grad`` clears them) and AdamW's ``exp_avg``/``exp_avg_sq`` (after one real step),
  each storage counted once;
- activations: the peak bytes of tensors saved for backward that are alive at once during one step's
  ``forward_backward``. A ``saved_tensors_hooks`` pack wraps each saved tensor in a holder object that the
  autograd graph owns; a ``weakref.finalize`` on the holder fires when the graph releases it (after that
  node's backward ran), and a per-storage refcount turns this into the live bytes of unique storages.
  Parameters and buffers are excluded (model state, as in tests/planner_measure.py). With TP this is one
  micro-batch's saved tensors; under a pipeline schedule it is the stage's peak over the micro-batches the
  schedule keeps in flight, which is what the planner's ``in_flight`` factor models.

Kept out of dist_trainer/planner (pure arithmetic); used by tests/test_planner_regimes.py and
benchmarks/planner_accuracy.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dist_trainer.config import Config
from dist_trainer.config_load import config_from_dict
from dist_trainer.data.objective import make_batch
from dist_trainer.planner.memory import Layout, Overheads, TrainingOptions, predict_rank_memory
from dist_trainer.train.plan_check import SavedPeak
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.planner_measure import mmap_large_allocations, status_bytes

# The cases tests/test_planner_regimes.py checks and benchmarks/planner_accuracy.py prints (tiny_config sections)
GPT2 = {"activation": "gelu_tanh"}
LLAMA = {"n_kv_heads": 2, "d_ff": 88, "pos_embedding": "rope", "norm": "rmsnorm", "activation": "swiglu",
         "bias": False, "tie_embeddings": False}
TP_CASES = {f"tp2-{name}{'-sp' if sp else ''}": {"model": model, "parallel": {"tp_size": 2, "sequence_parallel": sp}}
            for name, model in (("gpt2", GPT2), ("llama", LLAMA)) for sp in (False, True)}
# 4 layers (2 per stage), 4 micro-batches of 2: GPipe keeps 4 in flight on both stages, 1F1B 2 on stage 0, 1 on 1
PP_CASES = {f"pp2-{name}-{schedule}": {"model": {**model, "n_layers": 4},
                                       "parallel": {"pp_size": 2, "pp_schedule": schedule, "micro_batch_size": 2}}
            for name, model in (("gpt2", GPT2), ("llama", LLAMA)) for schedule in ("1f1b", "gpipe")}
# several M parameters (3.3M) so that model states and activations (tens of MB) dwarf allocator noise
BIG = {**GPT2, "d_model": 256, "n_layers": 4, "n_heads": 4}
RSS_CASES = {"tp2": {"model": BIG, "parallel": {"tp_size": 2}, "data": {"seq_len": 64}},
             "tp2-sp": {"model": BIG, "parallel": {"tp_size": 2, "sequence_parallel": True}, "data": {"seq_len": 64}},
             "pp2-1f1b": {"model": BIG, "parallel": {"pp_size": 2, "micro_batch_size": 2}, "data": {"seq_len": 64}},
             "pp2-gpipe": {"model": BIG, "parallel": {"pp_size": 2, "micro_batch_size": 2, "pp_schedule": "gpipe"},
                           "data": {"seq_len": 64}}}
# fp32, dropout 0 (so CPU SDPA runs its flash kernel), the saved-tensor figure with no overhead terms
OPTIONS = TrainingOptions(precision="fp32", device="cpu", attention_kernel="flash", sp_saves_gathered_input=True)


def options_for(cfg: Config) -> TrainingOptions:
    """OPTIONS with the run's train.freeze and optim.state_dtype (LoRA and int8 base weights travel with the model
    config)."""
    return dataclasses.replace(OPTIONS, freeze=tuple(cfg.train.freeze), optim_state_dtype=cfg.optim.state_dtype)


def case_config(data: Path, out: Path, sections: dict) -> Config:
    """tiny_config with the case's sections; a "data" section (tiny_config's own argument name) merged after."""
    sections = dict(sections)
    data_fields = sections.pop("data", {})
    tree = tiny_config(data, out, **sections).to_dict()
    tree["data"].update(data_fields)
    return config_from_dict(tree).validate()


def measure_case(data: Path, out: Path, sections: dict) -> dict:
    """One layout on this rank: measured model states and peak saved activations next to the planner's."""
    trainer = Trainer(case_config(data, out, sections), log=False)
    engine, cfg = trainer.engine, trainer.cfg

    def batches(step: int) -> list[dict[str, torch.Tensor]]:
        return [make_batch(cfg, trainer.train_data, idx, step) for idx in trainer.sampler.micro_batches(step)]

    trainer.train_step(0)  # creates AdamW's moments
    modules = [s.model for s in getattr(engine, "stages", [])] or [engine.model]
    state = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    step_batches = batches(1)
    n_micro = len(step_batches)
    with SavedPeak(state) as tracker:
        if cfg.parallel.pp_size == 1:  # one micro-batch: TP's per-micro-batch activations
            engine.forward_backward(step_batches[:1])
        else:  # the whole schedule step: the stage's peak over its in-flight micro-batches
            engine.forward_backward(step_batches)
    measured = dict(engine.owned_state_bytes())  # params, grads (all alive after backward), AdamW moments
    measured["model_states"] = measured["params"] + measured["grads"] + measured["optimizer"]
    measured["activations"] = tracker.peak
    engine.model.zero_grad(set_to_none=True)

    p = cfg.parallel
    layout = Layout(tp_size=p.tp_size, pp_size=p.pp_size, micro_batch_size=p.micro_batch_size,
                    n_microbatches=n_micro, sequence_parallel=p.sequence_parallel, pp_schedule=p.pp_schedule)
    pred = predict_rank_memory(cfg.model, layout, seq_len=cfg.data.seq_len, options=options_for(cfg),
                               overheads=Overheads.none(), pp_rank=trainer.state.pp_rank)
    predicted = {"params": pred.params, "grads": pred.grads, "optimizer": pred.optimizer,
                 "model_states": pred.model_states, "activations": pred.saved_activations}
    return {"rank": trainer.state.rank, "tp_rank": trainer.state.tp_rank, "pp_rank": trainer.state.pp_rank,
            "n_microbatches": n_micro, "measured": measured, "predicted": predicted}


def measure_cases(rank: int, world: int, data: Path, out: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """``run_distributed`` entry: every named case (tiny_config sections) on this rank, one Trainer each."""
    return {name: measure_case(data, out / name, sections) for name, sections in cases.items()}


def measure_peak_rss(rank: int, world: int, data: Path, out: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """``run_distributed`` entry: peak RSS growth of each case (Trainer built and two steps run) over a
    baseline taken after imports, data and process-group setup, with the peak reset (clear_refs 5) first;
    next to the planner's device total for this rank (no overhead terms: none of them exists on CPU)."""
    import gc

    libc = mmap_large_allocations()
    results = {}
    for name, sections in cases.items():
        # First use of a regime costs memory no model accounts for (lazy imports such as
        # torch.distributed.pipelining, thread pools, gloo's buffers): pay it once on a tiny twin.
        warm = {**sections, "model": {**sections.get("model", {}), "d_model": 32, "n_heads": 4, "d_ff": None}}
        Trainer(case_config(data, out / f"{name}-warm", warm), log=False).train_step(0)
        cfg = case_config(data, out / name, sections)
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = status_bytes("VmRSS")
        trainer = Trainer(cfg, log=False)
        for step in range(2):
            trainer.train_step(step)
        peak = status_bytes("VmHWM") - base
        p = trainer.cfg.parallel
        n_micro = len(trainer.sampler.micro_batches(0))
        layout = Layout(tp_size=p.tp_size, pp_size=p.pp_size, micro_batch_size=p.micro_batch_size,
                        n_microbatches=n_micro, sequence_parallel=p.sequence_parallel, pp_schedule=p.pp_schedule)
        pred = predict_rank_memory(trainer.cfg.model, layout, seq_len=trainer.cfg.data.seq_len,
                                   options=options_for(trainer.cfg), overheads=Overheads.none(),
                                   pp_rank=trainer.state.pp_rank)
        results[name] = {"rank": rank, "pp_rank": trainer.state.pp_rank, "measured": peak,
                         "predicted": pred.device_total, "model_states": pred.model_states,
                         "activations": pred.activations}
        del trainer
    return results
