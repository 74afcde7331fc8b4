"""DeepSpeed's ZeRO optimizer over this rank's module: shared by the ZeRO engine and the pipeline engine's ZeRO-1.

``DeepSpeedZero`` wraps ``deepspeed.initialize`` around a module that is already this rank's part of the model
(a TP shard, this rank's pipeline stages, or the plain model) and tagged by ``prepare_for_deepspeed``:

- the optimizer is our AdamW over ``optim.param_groups`` (torch's, ``foreach=False``, for exact parity with the
  other regimes; DeepSpeedCPUAdam in AdamW mode when the optimizer is offloaded), its LR set every step;
- DeepSpeed's data-parallel group is our dp axis and its model-parallel group the tp x pp block
  (``DeepSpeedMpu``), so ZeRO partitions each rank's shard over its dp replicas only, and its gradient norm
  (clipped to ``optim.grad_clip``) covers every shard and stage once;
- ``step`` is DeepSpeed's boundary step (reduce(-scatter), norm, clip, Adam on the partition, all-gather); for
  gradients that a pipeline schedule produced outside DeepSpeed, ``step(lr, reduce=True)`` first reduces them
  as DeepSpeed's own pipeline engine does (``_exec_reduce_grads`` -> ``reduce_gradients(pipeline_parallel=True)``,
  deepspeed/runtime/pipe/engine.py:287, runtime/zero/stage_1_and_2.py:958);
- checkpoints are DeepSpeed's own files (``save``), read back by ``checkpoint/deepspeed_files.py`` with
  ``torch.load(weights_only=True)`` (``load``): never through DeepSpeed's loaders, which unpickle freely.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_trainer.checkpoint.convert import load_shards, write_specs
from dist_trainer.checkpoint.deepspeed_files import MOMENTS, load_deepspeed_file, model_file, optim_file
from dist_trainer.config import Config
from dist_trainer.engines.base import StepHooks
from dist_trainer.optim import param_groups, set_lr
from dist_trainer.parallel.ownership import Piece
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.reshard import tp_shard_specs
from dist_trainer.parallel.zero.config import engine_config
from dist_trainer.parallel.zero.deepspeed import DeepSpeedMpu
from dist_trainer.parallel.zero.fragments import skip_next_step, zero_pieces
from dist_trainer.parallel.zero.memory import zero_owned_bytes

DS_TAG = "deepspeed"  # DeepSpeed's checkpoint tag: the sub-folder of the trainer's step folder
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def client_optimizer(params: Iterable[dict[str, Any]], cfg: Config) -> torch.optim.Optimizer:
    """Our AdamW for DeepSpeed to wrap: torch's (exact parity with DDP), or DeepSpeedCPUAdam in AdamW mode when
    the optimizer states live in host memory (DeepSpeed steps offloaded partitions with it)."""
    o = cfg.optim
    groups = list(params)
    if cfg.parallel.zero_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)


class DeepSpeedZero:
    """DeepSpeed's engine and ZeRO optimizer over ``model`` (this rank's part of the model, already tagged)."""

    def __init__(self, cfg: Config, state: ParallelState, model: nn.Module, ds_config: dict[str, Any],
                 mpu: DeepSpeedMpu) -> None:
        import deepspeed

        self.cfg, self.state, self.stage = cfg, state, cfg.parallel.zero_stage
        self.offload = cfg.parallel.zero_offload
        # full shapes decide decay under ZeRO-3 (param_groups reads ds_shape)
        optimizer = client_optimizer(param_groups(model, cfg.optim.weight_decay), cfg)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=engine_config(ds_config), mpu=mpu, dist_init_required=False)
        self.module: nn.Module = self.engine.module

    def step(self, lr: float, hooks: StepHooks, *, reduce: bool = False) -> torch.Tensor:
        """DeepSpeed's boundary step at ``lr``; the global gradient norm before clipping (0 for a skipped step).

        ``reduce``: the gradients were accumulated in ``.grad`` outside ``engine.backward`` (a pipeline schedule):
        hand them to ZeRO-1's reduction first, averaging over dp and keeping this rank's partition.
        ``hooks`` see the reduced gradients before the step; DeepSpeed measures the norm inside ``step()``, so
        they judge it without one, and a step they refuse goes down DeepSpeed's own overflow path
        (``fragments.skip_next_step``), its counters consistent.
        """
        if reduce:
            with self.state.dp.exchange("deepspeed reduce"):
                self.optimizer.reduce_gradients(pipeline_parallel=True)
        set_lr(self.optimizer, lr)  # ZeRO's wrapper shares the client optimizer's param_groups
        hooks.grads_ready()
        applied = hooks.allow_update(None)
        if not applied:
            skip_next_step(self.module, self.state, self.stage)
        with self.state.dp.exchange("deepspeed step"):  # DeepSpeed's collectives, for a hang report
            self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None or not applied else float(norm))

    def pieces(self, grads: bool = True) -> list[Piece]:
        """This rank's pieces of every trainable parameter (``parallel/zero/fragments.py``)."""
        return zero_pieces(self.module, self.state, self.stage, grads)

    def owned_state_bytes(self) -> dict[str, int]:
        params = list({id(p): p for p in self.module.parameters()}.values())
        return zero_owned_bytes(self.optimizer, params, self.stage)

    def save(self, folder: Path) -> dict[str, Any]:
        """Every rank writes its partition (DeepSpeed's ``zero_pp_rank_D_mp_rank_M_*`` files, M the (tp, pp)
        coordinate) under ``folder/DS_TAG``, and the first rank of each stage how its parameters are split over tp
        (what merging the coordinates by name needs); returns what meta.json records."""
        self.engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)  # ends with a barrier
        if self.state.rank == 0:
            # DeepSpeed copies its recovery scripts beside the files (engine.py _copy_recovery_script); they unpickle
            # with weights_only=False, so they are not shipped: `dist-trainer export` reads these files safely
            for script in RECOVERY_SCRIPTS:
                (folder / script).unlink(missing_ok=True)
        if self.state.dp_rank == 0 and self.state.tp_rank == 0:
            write_specs(folder, self.state.pp_rank, tp_shard_specs(self.module))
        return {"zero_stage": self.stage, "zero_offload": self.offload, "deepspeed_tag": DS_TAG}

    def load(self, folder: Path, meta: dict[str, Any]) -> None:
        """This rank's part of a checkpoint of any layout and regime.

        A checkpoint of this very layout (tp, pp, dp, ZeRO stage, offload, and the same parameters in the same
        flat order: a changed stage split or parameter grouping is not) is read natively: this rank's own
        partition file goes to DeepSpeed's optimizer as its engine would hand it over (exact resume, and no rank
        reads the others' partitions). Any other one is read by parameter name (``convert.load_shards``: merged
        over its tp x pp layout, consolidated from its dp partitions when it is a ZeRO checkpoint) and written into
        this rank's partitions (``_load_by_name``).
        """
        layout, s = meta["layout"], self.state
        if ("deepspeed_tag" in meta and (layout["tp"], layout["pp"], layout["dp"]) == (s.tp_size, s.pp_size, s.dp_size)
                and meta.get("zero_stage") == self.stage and bool(meta.get("zero_offload")) == self.offload):
            ds_dir = folder / meta["deepspeed_tag"]
            model_states = load_deepspeed_file(model_file(ds_dir, self.engine.mpu.get_model_parallel_rank(),
                                                          self.stage, s.dp_rank))
            if self._same_partitioning(model_states["param_shapes"]):
                self._load_native(ds_dir, model_states)
                return
        model_state, optim_state = load_shards(folder, meta, tp_rank=s.tp_rank, tp_size=s.tp_size,
                                               pp_rank=s.pp_rank, pp_size=s.pp_size,
                                               specs_now=tp_shard_specs(self.module))
        self._load_by_name(folder, model_state, optim_state)

    def _same_partitioning(self, saved: list[dict[str, Any]]) -> bool:
        """Whether the saved flat partitions hold this optimizer's parameters in this order (DeepSpeed's own record
        of what it flattened: ``engine._get_zero_param_shapes``, the ``param_shapes`` it saves). Without that
        method (another DeepSpeed version) the answer is no: the by-name path is always right, only slower."""
        current = getattr(self.engine, "_get_zero_param_shapes", None)
        if current is None:
            return False
        as_lists = [[(n, tuple(shape)) for n, shape in group.items()] for group in current()]
        return as_lists == [[(n, tuple(shape)) for n, shape in group.items()] for group in saved]

    def _load_native(self, ds_dir: Path, model_states: dict[str, Any]) -> None:
        """What ``engine.load_checkpoint`` does for a rigid (non-elastic) ZeRO checkpoint of the same layout
        (deepspeed/runtime/engine.py _load_checkpoint, _get_all_zero_checkpoint_state_dicts): the module's weights
        (ZeRO-1/2), then this rank's optimizer partition, the other ranks' entries left None as DeepSpeed leaves
        them; the files read by ``load_deepspeed_file`` (weights_only) instead of DeepSpeed's unpickler."""
        mp, dp = self.engine.mpu.get_model_parallel_rank(), self.state.dp_rank
        if self.stage < 3:  # ZeRO-3's saved module holds empty partitions: its weights come from the fp32 ones
            self.module.load_state_dict(model_states["module"], strict=True)
        own = load_deepspeed_file(optim_file(ds_dir, dp, mp))["optimizer_state_dict"]
        partitions: list[dict[str, Any] | None] = [None] * self.state.dp_size
        partitions[dp] = own
        self.optimizer.load_state_dict(partitions, load_optimizer_states=True, load_from_fp32_weights=True)
        for key in ("global_steps", "global_samples", "skipped_steps"):
            if key in model_states:
                setattr(self.engine, key, model_states[key])

    def _load_by_name(self, folder: Path, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        """Weights and AdamW moments by name (this rank's TP shard of each) into DeepSpeed's partitions.

        DeepSpeed's fragment API (deepspeed.utils.safe_set_full_*) writes each tensor's slice into this rank's fp32
        master and moment partitions. The AdamW state over the flat partitions is created first (torch's is lazy),
        with the saved step count (an int for DeepSpeedCPUAdam, a tensor for torch's AdamW).
        """
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        named = list(self.module.named_parameters())
        missing = [n for n, _ in named if n not in model_state]
        if missing:
            raise ValueError(f"checkpoint {folder} lacks parameters {missing[:5]}")
        saved = optim_state["state"]
        step = next((s["step"] for s in saved.values()), torch.tensor(0.0))
        base = self.optimizer.optimizer
        # Stage 3 attaches its flat fp32 partitions to the torch optimizer only around step() (stage3.py
        # _set_fp32_optimizer_param_groups); stages 1/2 keep them in param_groups.
        flats = list(self.optimizer.fp32_partitioned_groups_flat) if self.stage == 3 else \
            [flat for group in base.param_groups for flat in group["params"]]
        for flat in flats:
            count = int(step) if self.offload else torch.as_tensor(step, dtype=torch.float32).clone()
            base.state[flat] = {"step": count, "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):  # stages 1/2 link fragments lazily
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()
        for name, p in named:
            full = model_state[name].to(p.device, torch.float32)
            if p.requires_grad:  # a frozen parameter has no fp32 master partition (nor moments)
                safe_set_full_fp32_param(p, full)
            for key in MOMENTS:
                if name in saved and p.requires_grad:
                    safe_set_full_optimizer_state(p, saved[name][key].to(p.device, torch.float32), key)
            if self.stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(full)
            else:
                p.data.copy_(full)
