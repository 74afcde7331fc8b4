"""The optimizers by name (``optim.name``): one ``OptimizerEntry`` each. Torch-free, so the config, the layout rules
and the planner read the same facts the trainer builds from.

An entry declares what every other part of the package asks of an optimizer, so none of them names one:

    builder       "module:function" building it over parameter groups (``optim.build_optimizer`` resolves it)
    states        the per-parameter state tensors it keeps, each of the parameter's shape: what checkpoints save,
                  reshard over another layout (``parallel/tp/reshard.py``) and resume
    state_dtypes  the ``optim.state_dtype`` values it accepts (the low-bit moments of ``optim_lowbit.py`` are
                  options of the entries that have moments)
    state_bytes   its state bytes per parameter it takes, by state dtype (the planner's K, master copy apart)
    takes         which trainable parameters it steps, by name and full shape; the others go to ``fallback``

Adding an optimizer is one entry in ``OPTIMIZERS`` (and its builder).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Adam's two moments per parameter by optim.state_dtype (int8: plus an fp32 absmax per 256 values, facts/quant_sizes.py)
MOMENT_BYTES = {"fp32": 8, "bf16": 4, "int8": 2}
ADAM_STATES = ("exp_avg", "exp_avg_sq")
# The hidden matrices Muon orthogonalises: attention and MLP projections (dense, shared and routed experts', cross
# attention's). Embedding tables, the head, norms, biases and routers stay with the fallback (Jordan et al. 2024:
# "embeddings, the classifier head and scalar or vector parameters should be optimized with AdamW").
MUON_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj")


def every_parameter(name: str, shape: tuple[int, ...]) -> bool:
    return True


def hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D weight of an attention or MLP projection (``MUON_LEAVES``): what Muon takes."""
    parts = name.split(".")
    return len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in MUON_LEAVES


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer (module docstring)."""

    name: str
    builder: str  # "module:function": (groups, OptimConfig, shards) -> torch.optim.Optimizer
    states: tuple[str, ...]  # per-parameter state tensors (a scalar "step" besides, when it counts steps)
    state_dtypes: tuple[str, ...]  # optim.state_dtype values accepted
    state_bytes: Callable[[str], int]  # state bytes per parameter it takes, by optim.state_dtype
    takes: Callable[[str, tuple[int, ...]], bool] = every_parameter
    fallback: str | None = None  # the entry stepping the parameters this one does not take
    # the groups of the parameters it takes: {"use_muon": True} marks them for a builder that steps two kinds
    group_marks: tuple[tuple[str, bool], ...] = ()
    # the parallel.zero_stage values it runs under: DeepSpeed's ZeRO hands its client optimizer flat fp32
    # partitions, not matrices (an entry that cannot rebuild its matrices from them lists the stages it can)
    zero_stages: tuple[int, ...] | None = None  # None: every stage
    # under ZeRO: only as DeepSpeed's sole parallelism (tp, pp, ep 1, no offload), when its matrices are rebuilt from
    # DeepSpeed's flat partitions over dp alone
    zero_dp_only: bool = False

    def check_regime(self, p: Any, zero_stage: int | None = None) -> None:
        """ValueError naming the values when the entry does not run under ``p``'s regime: ``p`` a run config's
        parallel section or a Layout (its zero_stage, or ``zero_stage`` when given; tp, pp, ep and offload)."""
        stage = p.zero_stage if zero_stage is None else zero_stage
        degrees = (p.tp_size, p.pp_size, p.ep_size, p.zero_offload)
        if self.zero_stages is not None and stage not in self.zero_stages:
            raise ValueError(f"optim.name={self.name} runs under parallel.zero_stage "
                             f"{', '.join(map(str, self.zero_stages))} only, not {stage}")
        if self.zero_dp_only and stage > 0 and degrees != (1, 1, 1, False):
            raise ValueError(f"optim.name={self.name} under parallel.zero_stage={stage} runs with tp_size, "
                             f"pp_size, ep_size 1 and no zero_offload, not tp_size={degrees[0]}, pp_size={degrees[1]}, "
                             f"ep_size={degrees[2]}, zero_offload={degrees[3]}; use zero_stage 0 with those")

    def check_state_dtype(self, state_dtype: str) -> None:
        if state_dtype not in self.state_dtypes:
            raise ValueError(f"optim.state_dtype={state_dtype} does not apply to optim.name={self.name} (it accepts "
                             f"{', '.join(self.state_dtypes)})")


OPTIMIZERS: dict[str, OptimizerEntry] = {e.name: e for e in (
    OptimizerEntry("adamw", "dist_trainer.optim_lowbit:build_adamw", ADAM_STATES, ("fp32", "bf16", "int8"),
                   lambda dtype: MOMENT_BYTES[dtype]),
    # Muon: one fp32 momentum per matrix element; AdamW (fp32 moments) for the rest
    OptimizerEntry("muon", "dist_trainer.optim_muon:build_muon", ("momentum_buffer",), ("fp32",),
                   lambda dtype: 4, takes=hidden_matrix, fallback="adamw", group_marks=(("use_muon", True),),
                   zero_dp_only=True),
    # SGD with (heavy-ball) momentum: one fp32 buffer per parameter
    OptimizerEntry("sgd", "dist_trainer.optim_muon:build_sgd", ("momentum_buffer",), ("fp32",), lambda dtype: 4),
)}


def optimizer_entry(name: str) -> OptimizerEntry:
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def split_bytes(entry: OptimizerEntry, state_dtype: str) -> tuple[int, int]:
    """(state bytes per parameter the entry takes, per parameter its fallback takes; the fallback's moments fp32)."""
    fallback = OPTIMIZERS[entry.fallback].state_bytes("fp32") if entry.fallback else entry.state_bytes(state_dtype)
    return entry.state_bytes(state_dtype), fallback
