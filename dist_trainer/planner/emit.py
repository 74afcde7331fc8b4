"""Turn a planned layout into what runs it: a run config, a DeepSpeed config and a launch command
(``write_plan``: the three files ``plan --out`` writes)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from dist_trainer.config import CONFIG_ROOT, ModelConfig, ParallelConfig
from dist_trainer.config_load import config_from_dict
from dist_trainer.files import make_executable, output_dir
from dist_trainer.layout_rules import Layout
from dist_trainer.parallel.zero.config import OWNED_KEYS, ds_config_for
from dist_trainer.planner.memory import DEFAULT_OPTIONS, TrainingOptions
from dist_trainer.planner.price import PlannedLayout

LAUNCH_DIR = CONFIG_ROOT.parent / "launch"  # the project's launch scripts, beside configs/

# Planner precision -> train.precision (the trainer's bf16/fp16 are autocast over fp32 parameters).
TRAIN_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "amp_bf16": "bf16", "amp_fp16": "fp16"}


def parallel_config_dict(layout: Layout) -> dict[str, Any]:
    """The ``parallel`` section: every ParallelConfig field the layout has, read by name off the two dataclasses
    (a field added to both travels without a line here)."""
    out = {f.name: getattr(layout, f.name) for f in dataclasses.fields(ParallelConfig) if hasattr(layout, f.name)}
    if out.get("pp_stage_layers") is not None:
        out["pp_stage_layers"] = list(out["pp_stage_layers"])  # YAML and the config hold a list
    return out


def run_config_dict(model: ModelConfig, layout: Layout, *, seq_len: int,
                    options: TrainingOptions = DEFAULT_OPTIONS) -> dict[str, Any]:
    """A config tree that dist_trainer.config_load.config_from_dict accepts (model fields spelled out)."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k != "preset"}
    optim = {**({"state_dtype": options.optim_state_dtype} if options.optim_state_dtype != "fp32" else {}),
             **({"name": options.optimizer} if options.optimizer not in ("adam", "adamw") else {})}
    return {
        "model": fields,
        "parallel": parallel_config_dict(layout),
        "data": {"seq_len": seq_len, **_seq2seq_data(model, options)},
        **({"optim": optim} if optim else {}),
        "train": {"precision": TRAIN_PRECISION[options.precision],
                  **({"compile": True} if options.fused_elementwise else {}),
                  **({"freeze": list(options.freeze)} if options.freeze else {})},
    }


def _seq2seq_data(model: ModelConfig, options: TrainingOptions) -> dict[str, Any]:
    """An encoder-decoder's data fields: span corruption (T5's pretraining) unless the plan is for seq2seq pairs
    (padded sources), and the decoder's length when the plan names one."""
    if not model.encoder_decoder:
        return {}
    target = {} if options.target_len is None else {"target_len": options.target_len}
    return {"objective": "seq2seq" if options.source_mask else "span_corruption", **target}


def deepspeed_config_dict(model: ModelConfig, layout: Layout, *, seq_len: int,
                          options: TrainingOptions = DEFAULT_OPTIONS) -> dict[str, Any] | None:
    """The DeepSpeed JSON of a ZeRO layout (None for zero_stage 0): the run config's, from the one generator
    that fills ``configs/ds/`` files for the trainer (``parallel/zero/config.ds_config_for``)."""
    if layout.zero_stage == 0:
        return None
    cfg = config_from_dict(run_config_dict(model, layout, seq_len=seq_len, options=options))
    return ds_config_for(cfg, layout.dp_size, options.device)


def _placeholder(var: str, what: str) -> str:
    """``"${VAR:?what}"``: the value from the environment, or bash stops with ``VAR: what`` before launching."""
    return f'{var}="${{{var}:?{what}}}"'


def launch_command(layout: Layout, *, gpus_per_node: int, config_path: str = "run.yaml",
                   launch_dir: str = "launch", no_ssh: bool = False) -> str:
    """The project launch script that runs ``layout``, as one bash command line (run from the repo root,
    or pass ``launch_dir`` where the scripts live, e.g. ``/opt/dist_trainer/launch`` in the images).

    ZeRO stage 0 -> ``launch/torchrun.sh`` (NNODES, NPROC_PER_NODE); stages 1-3 -> ``launch/deepspeed.sh``
    (NUM_GPUS, and for several nodes NUM_NODES with a HOSTFILE). What only the cluster knows is left as
    ``NAME="${NAME:?...}"``: taken from the environment, or bash stops naming what to set: MASTER_ADDR and
    NODE_RANK on every node for torchrun (and for deepspeed with ``no_ssh``, its per-node mode), HOSTFILE
    for deepspeed. MASTER_PORT is left to the scripts (default 29500, overridable from the environment).
    """
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")
    world = layout.world_size
    per_node = min(world, gpus_per_node)
    if world % per_node:
        raise ValueError(f"a world of {world} processes (tp {layout.tp_size} x pp {layout.pp_size} x "
                         f"dp {layout.dp_size}) does not fill whole nodes of gpus_per_node={gpus_per_node}; "
                         f"every launcher starts the same number per node: plan a world that is a multiple of "
                         f"{gpus_per_node} or at most {gpus_per_node}")
    nodes = world // per_node
    if no_ssh and layout.zero_stage == 0:
        raise ValueError("no_ssh=True is the deepspeed launcher's per-node mode (zero_stage > 0); torchrun "
                         f"never uses ssh (this layout has zero_stage={layout.zero_stage})")
    node_rank = _placeholder("NODE_RANK", f"the index of this node, 0..{nodes - 1}")
    master = _placeholder("MASTER_ADDR", "the address of node 0, reachable from every node")
    args = f"--config {shlex.quote(config_path)}"
    if layout.zero_stage == 0:
        env = [f"NPROC_PER_NODE={per_node}"]
        if nodes > 1:
            env = [f"NNODES={nodes}", node_rank, master, *env]
        return " ".join([*env, f"{launch_dir}/torchrun.sh", args])
    env = [f"NUM_GPUS={per_node}"]
    if nodes > 1:
        env += [_placeholder("HOSTFILE", f"a deepspeed hostfile naming the {nodes} nodes, node 0 first "
                                         "(launch/hostfile.example)"), f"NUM_NODES={nodes}"]
        if no_ssh:
            env += ["NO_SSH=1", node_rank, master]
    elif no_ssh:
        raise ValueError(f"no_ssh=True needs several nodes; this layout fits one ({world} <= {gpus_per_node})")
    return " ".join([*env, f"{launch_dir}/deepspeed.sh", args])


def write_plan(out: Path, cfg: ModelConfig, best: PlannedLayout, *, seq_len: int, opts: TrainingOptions,
               gpus_per_node: int) -> list[Path]:
    """``plan --out``: ``out/run.yaml``, ``out/ds_config.json`` (ZeRO layouts) and ``out/launch.sh`` for ``best``;
    returns the files written."""
    output_dir(out, "--out")
    cfg = dataclasses.replace(cfg, loss_chunk_tokens=best.loss_chunk_tokens)  # the chunk it was priced with
    run = run_config_dict(cfg, best.layout, seq_len=seq_len, options=opts)
    ds = deepspeed_config_dict(cfg, best.layout, seq_len=seq_len, options=opts)
    if ds is not None:
        # DeepSpeed's own sections only: what the run config owns (batch, precision, clipping, optimizer, schedule)
        # is filled from run.yaml at launch, so `launch.sh --train.max_steps=N` does not contradict the file
        ds = {k: v for k, v in ds.items() if k not in OWNED_KEYS}
        (out / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
        run["parallel"]["ds_config"] = str(out / "ds_config.json")
    (out / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    # absolute paths: launch.sh runs from any folder (the images keep the scripts in /opt/dist_trainer/launch)
    cmd = launch_command(best.layout, gpus_per_node=gpus_per_node, config_path=str((out / "run.yaml").resolve()),
                         launch_dir=str(LAUNCH_DIR))
    # extra arguments are the trainer's overrides: `bash plan/launch.sh --train.max_steps=100`
    (out / "launch.sh").write_text(
        f"#!/usr/bin/env bash\n# {best.layout.describe()}\nset -euo pipefail\n{cmd} \"$@\"\n")
    make_executable(out / "launch.sh")
    return [out / name for name in ("run.yaml", "ds_config.json", "launch.sh")
            if name != "ds_config.json" or ds is not None]
