"""`dist-trainer memory-experiment`: measured against predicted per-rank memory for ZeRO stages 0-3, for each of
the optimizers (``--optimizers adamw,muon,sgd``: the stages each entry runs under) and AdamW state dtypes asked for
(``--optim-state-dtype fp32,bf16,int8``).

For each stage the same model (a preset, drawn from one seed) takes the same synthetic batch on N gloo
processes. Each rank reports the bytes it really owns in parameters, gradients and optimizer states
(``Engine.owned_state_bytes``: the largest value over the micro-batches of a step, so stage 1's
full gradients during accumulation are seen), the activation bytes saved for backward (saved-tensor hooks,
unique storages, parameters excluded), peak RSS on CPU or max allocated on CUDA, and the step time.
Predictions: the ZeRO paper's family (Rajbhandari et al. 2019, section 3.1 and figure 1:
params + grads + K Psi with K sharded by stage 1, grads by 2, params by 3) in our fp32 AdamW run, and the
planner's ``predict_rank_memory``. Writes memory.md, memory.json and memory.png into --out.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dist_trainer.config import OPTIM_STATE_DTYPES, ZERO_STAGES, Config
from dist_trainer.config_load import config_from_dict
from dist_trainer.optim_entries import optimizer_entry

if TYPE_CHECKING:
    import torch  # imported where it runs: `dist-trainer --help` and the planner subcommands stay torch-free

STEPS = 3  # step 0 creates the optimizer states; steps 1.. are measured and timed
N_MICRO = 2  # micro-batches per rank per step: stage 1 keeps full grads between them, stage 2 does not


def experiment_config(model: str | dict[str, Any], stage: int, nprocs: int, *, offload: bool = False,
                      micro_batch_size: int = 2, seq_len: int = 32, state_dtype: str = "fp32",
                      optimizer: str = "adamw", freeze: tuple[str, ...] = ()) -> Config:
    model_fields = {"preset": model} if isinstance(model, str) else dict(model)
    return config_from_dict({
        "model": {**model_fields, "dropout": 0.0},
        "parallel": {"zero_stage": stage, "zero_offload": offload and stage > 0, "micro_batch_size": micro_batch_size,
                     "global_batch_size": micro_batch_size * N_MICRO * nprocs},
        "data": {"seq_len": seq_len},
        "train": {"device": "cpu", "seed": 1234, "max_steps": STEPS, "freeze": list(freeze)},
        "optim": {"warmup_steps": 0, "state_dtype": state_dtype, "name": optimizer},
        "wandb": {"mode": "disabled"},
    }).validate()


def _batches(cfg: Config, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    import torch

    g = torch.Generator().manual_seed(cfg.train.seed * 1000 + step * 100 + dp_rank)
    shape = (cfg.parallel.micro_batch_size, cfg.data.seq_len + 1)
    out = []
    for _ in range(N_MICRO):
        seq = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append({"tokens": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()})
    return out


def measure_rank(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of one stage (run under dist_trainer.testing.run_distributed)."""
    import torch

    from dist_trainer.config_load import config_from_dict as build
    from dist_trainer.engines import build_engine
    from dist_trainer.parallel.state import ParallelState

    cfg = build(cfg_dict).validate()
    state = ParallelState.build(cfg.parallel, world_size, rank)
    engine = build_engine(cfg, state, torch.device("cpu"))
    peak: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0}

    def record() -> None:
        for k, v in engine.owned_state_bytes().items():
            peak[k] = max(peak[k], v)

    per_micro: list[set[tuple[int, int]]] = []
    measuring = [False]

    def new_micro_batch(module: torch.nn.Module, args: Any) -> None:
        if measuring[0]:
            per_micro.append(set())

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Parameters saved by linears (or their views; ZeRO-3's gathered buffers) are model states, not activations.
        storage = t.untyped_storage()
        if measuring[0] and storage.nbytes() > 0 and not isinstance(t, torch.nn.Parameter) and \
                storage.data_ptr() not in {p.untyped_storage().data_ptr() for p in engine.model.parameters()}:
            per_micro[-1].add((storage.data_ptr(), storage.nbytes()))
        return t

    engine.model.register_forward_pre_hook(new_micro_batch)
    times = []
    for step in range(STEPS):
        measured = step > 0
        engine.after_backward = record if measured else None  # type: ignore[attr-defined]
        measuring[0] = measured
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            engine.forward_backward(_batches(cfg, step, state.dp_rank))
        if measured:
            record()  # DDP: the grads after the step's last backward
        engine.optimizer_step(cfg.optim.lr)
        times.append(time.perf_counter() - t0)
    activations = max(sum(n for _, n in s) for s in per_micro)
    peak_mem = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**peak, "model_states": sum(peak.values()), "activations": activations, "peak_memory": peak_mem,
            "step_time_s": sum(times[1:]) / (len(times) - 1)}


def predictions(cfg: Config, nprocs: int) -> dict[str, dict[str, int]]:
    """Per-rank model-state bytes: the paper's family in fp32 (4 + 4 + K bytes per parameter) and the planner's."""
    from dist_trainer.facts.finetune import frozen_modules
    from dist_trainer.model import build_model, count_parameters
    from dist_trainer.model_lora import count_trainable, freeze_
    from dist_trainer.optim_entries import split_bytes
    from dist_trainer.planner.memory import Layout, Overheads, TrainingOptions, predict_rank_memory

    model = build_model(cfg.model, device="meta")
    freeze_(model, frozen_modules(cfg.model, cfg.train.freeze))  # as the engines do (engines/base.start_finetune)
    psi, trainable = count_parameters(model), count_trainable(model)  # LoRA: gradients and states for adapters only
    stage = cfg.parallel.zero_stage
    # K = 8 (AdamW moments; 4 in bf16, 2 in int8 before their block scales; SGD's momentum 4); DeepSpeed's ZeRO
    # optimizers add an fp32 master partition even for an fp32 model (stage_1_and_2.py
    # single_partition_of_fp32_groups, stage3.py fp32_partitioned_groups_flat): K = 12 (8 with bf16 moments, 6 with
    # int8 ones). An entry with a fallback (Muon) is K_own on the parameters it takes (counted here on the model by
    # the entry's rule) and K_fallback on the rest.
    entry = optimizer_entry(cfg.optim.name)
    own, fallback = split_bytes(entry, cfg.optim.state_dtype)
    taken = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and entry.takes(n, tuple(p.shape))) \
        if entry.fallback else trainable
    master = 4 if stage > 0 else 0
    paper = {"params": 4 * psi // (nprocs if stage >= 3 else 1),
             "grads": 4 * trainable // (nprocs if stage >= 2 else 1),
             "optimizer": (master * trainable + own * taken + fallback * (trainable - taken))
             // (nprocs if stage >= 1 else 1)}
    layout = Layout(dp_size=nprocs, zero_stage=stage, zero_offload=cfg.parallel.zero_offload,
                    micro_batch_size=cfg.parallel.micro_batch_size, n_microbatches=N_MICRO)
    planned = predict_rank_memory(cfg.model, layout, seq_len=cfg.data.seq_len,
                                  # SDPA runs its flash kernel without dropout, the math path with it
                                  options=TrainingOptions(precision="fp32", device="cpu", attention_kernel="flash"
                                                          if cfg.model.dropout == 0 else "math",
                                                          optim_state_dtype=cfg.optim.state_dtype,
                                                          optimizer=cfg.optim.name, freeze=tuple(cfg.train.freeze)),
                                  overheads=Overheads.none())
    paper["model_states"] = sum(paper.values())
    return {"paper": paper, "planner": {"params": planned.params, "grads": planned.grads,
                                        "optimizer": planned.optimizer, "model_states": planned.model_states,
                                        "activations": planned.saved_activations, "host": planned.host},
            "n_params": {"psi": psi, "trainable": trainable}}


def measure_ranks(rank: int, world_size: int, cfg_dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``measure_rank`` of each config in turn, in one set of processes (one spawn for every row)."""
    return [measure_rank(rank, world_size, c) for c in cfg_dicts]


def run_experiment(model: str | dict[str, Any], stages: list[int], nprocs: int, out: Path, *,
                   offload: bool = False, seq_len: int = 32, micro_batch_size: int = 2,
                   state_dtypes: tuple[str, ...] = ("fp32",), optimizers: tuple[str, ...] = ("adamw",)
                   ) -> dict[str, Any]:
    """One row per optimizer (``optim.name``), AdamW state dtype and ZeRO stage each optimizer's entry runs under
    (its state dtypes, its ZeRO stages)."""
    from dist_trainer.experiments.report import write_chart, write_markdown
    from dist_trainer.testing import run_distributed

    out.mkdir(parents=True, exist_ok=True)
    entries = [optimizer_entry(name) for name in optimizers]
    cfgs = [experiment_config(model, stage, nprocs, offload=offload, seq_len=seq_len,
                              micro_batch_size=micro_batch_size, state_dtype=dtype, optimizer=e.name)
            for e in entries for dtype in state_dtypes for stage in stages
            if dtype in e.state_dtypes and (e.zero_stages is None or stage in e.zero_stages)]
    per_rank = run_distributed(measure_ranks, nprocs, ([c.to_dict() for c in cfgs],), env={"DS_ACCELERATOR": "cpu"})
    rows = []
    for i, cfg in enumerate(cfgs):
        ranks = [r[i] for r in per_rank]
        rows.append({"stage": cfg.parallel.zero_stage, "offload": cfg.parallel.zero_offload, "nprocs": nprocs,
                     "state_dtype": cfg.optim.state_dtype, "optimizer": cfg.optim.name, "ranks": ranks,
                     "measured": max(ranks, key=lambda r: r["model_states"]), **predictions(cfg, nprocs)})
    result = {"model": model, "seq_len": seq_len, "micro_batch_size": micro_batch_size, "n_micro": N_MICRO,
              "rows": rows}
    (out / "memory.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, out / "memory.md")
    write_chart(result, out / "memory.png")
    return result


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("memory-experiment", help="measure per-rank memory of ZeRO stages against predictions")
    p.add_argument("--model", default="tiny", help="model preset (configs/models/) or YAML path")
    p.add_argument("--stages", default=",".join(map(str, ZERO_STAGES)), help="comma-separated ZeRO stages (0 = DDP)")
    p.add_argument("--nprocs", type=int, default=2, help="gloo processes (data-parallel degree)")
    p.add_argument("--offload", action="store_true", help="offload optimizer (stage 3: and params) to CPU")
    p.add_argument("--optim-state-dtype", default="fp32",
                   help="comma-separated optim.state_dtype values (fp32, bf16, int8): every stage for each")
    p.add_argument("--optimizers", default="adamw",
                   help="comma-separated optim.name entries (adamw, muon, sgd): each under the stages and state dtypes "
                        "its entry runs with")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--out", default="runs/memory_experiment", help="folder for memory.md/.json/.png")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--stages={args.stages!r} must be comma-separated integers among 0,1,2,3") from None
    bad = [s for s in stages if s not in ZERO_STAGES]
    if bad or not stages:
        raise ValueError(f"--stages={args.stages!r}: stages must be among 0,1,2,3")
    if args.nprocs < 1:
        raise ValueError(f"--nprocs={args.nprocs} must be >= 1")
    dtypes = tuple(d.strip() for d in args.optim_state_dtype.split(",") if d.strip())
    if not dtypes or any(d not in OPTIM_STATE_DTYPES for d in dtypes):
        raise ValueError(f"--optim-state-dtype={args.optim_state_dtype!r} must be comma-separated values among "
                         f"{', '.join(OPTIM_STATE_DTYPES)}")
    optimizers = tuple(o.strip() for o in args.optimizers.split(",") if o.strip())
    for name in optimizers:
        optimizer_entry(name)  # ValueError naming it when it is not an entry
    result = run_experiment(args.model, stages, args.nprocs, Path(args.out), offload=args.offload,
                            seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, state_dtypes=dtypes,
                            optimizers=optimizers)
    print((Path(args.out) / "memory.md").read_text())
    return 0 if result["rows"] else 1
