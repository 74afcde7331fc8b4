"""DeepSpeed's ZeRO optimizer over this rank's module: shared by the ZeRO engine and the pipeline engine's ZeRO-1.

``DeepSpeedZero`` wraps ``deepspeed.initialize`` around this rank's part of the model (a TP shard, its pipeline
stages, or the plain model), tagged by ``prepare_for_deepspeed``. The optimizer is ``optim.name``'s (built by its
entry, as the other regimes build it, for exact parity; DeepSpeedCPUAdam when offloaded). DeepSpeed's data-parallel
group is our dp axis and its model-parallel group the tp x pp block (``DeepSpeedMpu``), so ZeRO partitions each
rank's shard over its dp replicas only and its clipped gradient norm covers every shard and stage once. ``step`` is
DeepSpeed's boundary step; ``step(lr, reduce=True)`` first reduces gradients a pipeline schedule produced outside
DeepSpeed. Checkpoints are DeepSpeed's own files, read back with ``torch.load(weights_only=True)``
(``checkpoint/deepspeed_files.py``), never through DeepSpeed's loaders, which unpickle freely. With expert
parallelism DeepSpeed's MoE conventions are set up for our groups, here and nowhere else (the section at the end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_trainer.checkpoint import publish
from dist_trainer.checkpoint.async_save import staging_active
from dist_trainer.checkpoint.checkpoint_source import load_shards
from dist_trainer.checkpoint.convert import optimizer_state_by_name, write_specs
from dist_trainer.checkpoint.deepspeed_files import load_deepspeed_file, model_file, optim_file
from dist_trainer.config import Config
from dist_trainer.engines.update import nothing, write_named_shards
from dist_trainer.health.hooks import StepHooks
from dist_trainer.model_blocks import set_attrs
from dist_trainer.model_moe import expert_bias_buffers
from dist_trainer.optim import build_from_groups, build_optimizer, group_states, param_groups, param_states, set_lr
from dist_trainer.optim_lowbit import canonical_states
from dist_trainer.parallel.comm import AxisGroup
from dist_trainer.parallel.ep.apply import group_name, is_expert_param
from dist_trainer.parallel.int8 import int8_buffer_names, int8_buffers
from dist_trainer.parallel.ownership import Piece
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.reshard import tp_shard_specs
from dist_trainer.parallel.zero.config import engine_config
from dist_trainer.parallel.zero.deepspeed import DeepSpeedMpu
from dist_trainer.parallel.zero.fragments import skip_next_step, zero_pieces
from dist_trainer.parallel.zero.memory import zero_owned_bytes

DS_TAG = "deepspeed"  # DeepSpeed's checkpoint tag: the sub-folder of the trainer's step folder
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def client_optimizer(params: Iterable[dict[str, Any]], cfg: Config, dp: AxisGroup | None = None
                     ) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer for DeepSpeed to wrap, built by its registry entry as the DDP engine's is
    (``optim.build_from_groups``), or DeepSpeedCPUAdam in AdamW mode when the optimizer states live in host memory
    (DeepSpeed steps offloaded partitions with it; fp32 moments only, ``layout_rules.check_low_bit``)."""
    o = cfg.optim
    groups = [g for g in params if g["params"]]  # DeepSpeed flattens each group: an empty one has nothing to hold
    if cfg.parallel.zero_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, adamw_mode=True)
    return build_from_groups(groups, o, zero=dp)


def staged_checkpoint_engine() -> Any:
    """DeepSpeed's torch checkpoint engine (``engine.checkpoint_engine``: every file of ``save_checkpoint`` goes
    through its ``save``), except that during an asynchronous save's staging (``train.async_save``) each file is
    handed to ``publish.atomic_save``, which stages it in host memory for the rank's writer thread (its collectives
    and ZeRO-3's gathers stay on the main thread, in ``save_checkpoint``)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class StagedCheckpointEngine(TorchCheckpointEngine):
        def save(self, state_dict: Any, path: str) -> None:
            if staging_active():
                publish.atomic_save(state_dict, Path(path))
            else:
                super().save(state_dict, path)

        def preserves_storage_sharing(self) -> bool:
            # DeepSpeed clones views of its flat buffers before torch.save keeps their whole storage; the staged
            # copy is already one buffer per tensor
            return not staging_active()

    return StagedCheckpointEngine()


class DeepSpeedZero:
    """DeepSpeed's engine and ZeRO optimizer over ``model`` (this rank's part of the model, already tagged)."""

    async_checkpoints = True  # DeepSpeed's files go through StagedCheckpointEngine, so train.async_save stages them

    def __init__(self, cfg: Config, state: ParallelState, model: nn.Module, ds_config: dict[str, Any],
                 mpu: DeepSpeedMpu, *, grads_from_schedule: bool = False) -> None:
        import deepspeed

        self.cfg, self.state, self.stage = cfg, state, state.layout.zero_stage
        self.grads_from_schedule = grads_from_schedule
        self.offload = cfg.parallel.zero_offload
        groups = param_groups(model, cfg.optim)  # full shapes decide decay under ZeRO-3 (ds_shape)
        if state.ep_size > 1:  # DeepSpeed's MoE conventions for our expert-parallel layers (the section at the end)
            _register_expert_groups(state)  # collective
            if any(is_expert_param(p) and p.requires_grad for p in model.parameters()):
                _mark_moe_model(model, cfg.model.n_experts, state.ep_size)
                groups = _moe_param_groups(groups)
        optimizer = client_optimizer(groups, cfg, state.replicas)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=engine_config(ds_config), mpu=mpu, dist_init_required=False)
        self.engine.checkpoint_engine = staged_checkpoint_engine()
        self.module: nn.Module = self.engine.module
        follow = getattr(optimizer, "follow_zero3", None)  # a client optimizer of whole matrices (optim_muon.py)
        if self.stage == 3 and follow is not None:  # asks which parameters' partitions each ZeRO-3 flat holds
            follow(self.optimizer)

    def after_backward(self) -> None:
        """Nothing: DeepSpeed reduces in its own step."""

    def step(self, lr: float, hooks: StepHooks, finalize: Callable[[], None] = nothing) -> torch.Tensor:
        """``finalize`` (the regime's own gradient step: the pipeline's tied embedding, on the whole ``.grad``
        before ZeRO's dp reduction), then DeepSpeed's boundary step at ``lr``; the global gradient norm before
        clipping (0 for a skipped step).

        ``grads_from_schedule``: the gradients were accumulated in ``.grad`` outside ``engine.backward`` (a
        pipeline schedule):
        hand them to ZeRO-1's reduction first, averaging over dp and keeping this rank's partition, as DeepSpeed's
        own pipeline engine does (``_exec_reduce_grads`` -> ``reduce_gradients(pipeline_parallel=True)``,
        deepspeed/runtime/pipe/engine.py:287, runtime/zero/stage_1_and_2.py:958).
        ``hooks`` see the reduced gradients before the step; DeepSpeed measures the norm inside ``step()``, so
        they judge it without one, and a step they refuse goes down DeepSpeed's own overflow path
        (``fragments.skip_next_step``), its counters consistent.
        """
        finalize()
        if self.grads_from_schedule:
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
        params: list[torch.Tensor] = list({id(p): p for p in self.module.parameters()}.values())
        return zero_owned_bytes(self.optimizer, params + int8_buffers(self.module), self.stage)

    def save(self, folder: Path) -> dict[str, Any]:
        """Every rank writes its partition (DeepSpeed's ``zero_pp_rank_D_mp_rank_M_*`` files, M the (tp, pp)
        coordinate) under ``folder/DS_TAG``, and the first rank of each stage how its parameters are split over tp
        (what merging the coordinates by name needs); returns what meta.json records. With expert parallelism the
        full fp32 weights and moments are gathered by name (collective) and written as every other regime does."""
        if self.state.ep_size > 1:
            weights, moments = self._state_by_name()
            # the plain optimizer's groups by name (decay membership, hyper-parameters), as the DDP and pipeline
            # engines'
            groups = optimizer_state_by_name(self.module, build_optimizer(self.module, self.cfg.optim))["param_groups"]
            if self.state.edp.rank == 0:
                write_named_shards(folder, self.state, self.module, weights, {"state": moments, "param_groups": groups})
            return {}
        self.engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)  # ends with a barrier
        if self.state.rank == 0:
            # DeepSpeed copies its recovery scripts beside the files (engine.py _copy_recovery_script); they unpickle
            # with weights_only=False, so they are not shipped: `dist-trainer export` reads these files safely
            for script in RECOVERY_SCRIPTS:
                (folder / script).unlink(missing_ok=True)
        if self.state.replicas.rank == 0 and self.state.tp_rank == 0:
            write_specs(folder, self.state.pp_rank, tp_shard_specs(self.module))
        return {"zero_stage": self.stage, "zero_offload": self.offload, "deepspeed_tag": DS_TAG}

    def load(self, folder: Path, meta: dict[str, Any]) -> None:
        """This rank's part of a checkpoint of any layout and regime.

        A checkpoint of this very layout (tp, pp, dp, ZeRO stage, offload, and the same parameters in the same
        flat order: a changed stage split or parameter grouping is not) is read natively: this rank's own
        partition file goes to DeepSpeed's optimizer as its engine would hand it over (exact resume, and no rank
        reads the others' partitions). Any other one is read by parameter name (``checkpoint_source.load_shards``:
        sliced over its tp x pp layout, consolidated from its dp partitions when it is a ZeRO checkpoint) and written
        into this rank's partitions (``_load_by_name``).
        """
        layout, s = meta["layout"], self.state
        saved_dtype = meta.get("config", {}).get("optim", {}).get("state_dtype", "fp32")
        if ("deepspeed_tag" in meta and all(layout.get(axis, 1) == n for axis, n in s.mesh.shape.items())
                and meta.get("zero_stage") == self.stage and bool(meta.get("zero_offload")) == self.offload
                and saved_dtype == self.cfg.optim.state_dtype):
            ds_dir = folder / meta["deepspeed_tag"]
            model_states = load_deepspeed_file(model_file(ds_dir, self.engine.mpu.get_model_parallel_rank(),
                                                          self.stage, s.replicas.rank))
            if self._same_partitioning(model_states["param_shapes"]):
                self._load_native(ds_dir, model_states)
                return
        model_state, optim_state = load_shards(folder, meta, tp_rank=s.tp_rank, tp_size=s.tp_size,
                                               pp_rank=s.pp_rank, pp_size=s.pp_size,
                                               specs_now=tp_shard_specs(self.module), ep_size=s.ep_size)
        self._load_by_name(folder, model_state, optim_state)

    def _state_by_name(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """(fp32 weights, {name: {step, exp_avg, exp_avg_sq}}) of every parameter this rank holds, whole (a frozen
        one: its weights alone). Collective: every rank walks its parameters in the same order, each gather running
        over that parameter's partition group (dp for dense parameters, edp for experts)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        # ZeRO-1/2 link each parameter to its AdamW moments after the first group's first step (stage_1_and_2.py,
        # _lazy_init_hp_params_optimizer_state), before the other groups' moments exist: link again now they do
        self.optimizer._hp_optimizer_states_linked = False
        self.optimizer._lazy_init_hp_params_optimizer_state()
        step = next((s["step"] for s in self.optimizer.optimizer.state.values() if "step" in s), torch.tensor(0.0))
        weights: dict[str, torch.Tensor] = {}
        moments: dict[str, dict[str, Any]] = {}
        for name, p in self.module.named_parameters():
            if not p.requires_grad:  # frozen (train.freeze, LoRA's base): no fp32 master nor moments; whole at ZeRO-1/2
                weights[name] = p.detach().float().cpu()
                continue
            weights[name] = safe_get_full_fp32_param(p).detach().cpu()
            moments[name] = {"step": torch.as_tensor(step, dtype=torch.float32).clone().cpu(),
                             **{k: safe_get_full_optimizer_state(p, k).detach().cpu()
                                for k in param_states(name, p, self.cfg.optim)}}
        weights.update({name: buf.detach().cpu() for name, buf in expert_bias_buffers(self.module).items()})
        return weights, moments

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
        mp, dp = self.engine.mpu.get_model_parallel_rank(), self.state.replicas.rank  # DeepSpeed's data-parallel rank
        if self.stage < 3:  # ZeRO-3's saved module holds empty partitions: its weights come from the fp32 ones
            self.module.load_state_dict(model_states["module"], strict=True)
        own = load_deepspeed_file(optim_file(ds_dir, dp, mp))["optimizer_state_dict"]
        partitions: list[dict[str, Any] | None] = [None] * self.state.replicas.size
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
        saved = canonical_states(optim_state["state"])  # fp32 moments, whatever optim.state_dtype saved them in
        # the step count of the entries that count steps (a momentum's, Muon's, counts none)
        step = torch.tensor(max((float(s["step"]) for s in saved.values()), default=0.0))
        base = self.optimizer.optimizer
        # Stage 3 attaches its flat fp32 partitions to the torch optimizer only around step() (stage3.py
        # _set_fp32_optimizer_param_groups); stages 1/2 keep them in param_groups.
        # (flat partition, the state tensors its group keeps: an entry's and its fallback's differ)
        flats = [(f, group_states(base.param_groups[self.optimizer.sub_group_to_group_id[i]], self.cfg.optim))
                 for i, f in enumerate(self.optimizer.fp32_partitioned_groups_flat)] if self.stage == 3 else \
            [(flat, group_states(group, self.cfg.optim)) for group in base.param_groups for flat in group["params"]]
        for flat, keys in flats:
            count = int(step) if self.offload else torch.as_tensor(step, dtype=torch.float32).clone()
            base.state[flat] = {"step": count, **{k: torch.zeros_like(flat) for k in keys}}
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):  # stages 1/2 link fragments lazily
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()
        for name, p in named:
            full = model_state[name].to(p.device, torch.float32)
            if p.requires_grad:  # a frozen parameter has no fp32 master partition (nor moments)
                safe_set_full_fp32_param(p, full)
            for key in param_states(name, p, self.cfg.optim):
                if name in saved and p.requires_grad:
                    safe_set_full_optimizer_state(p, saved[name][key].to(p.device, torch.float32), key)
            if self.stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(full)
            else:
                p.data.copy_(full)
        adopt = getattr(base, "adopt_canonical_state_", None)  # bf16 / int8 moments: the fp32 ones converted
        if adopt is not None:
            for flat, _ in flats:
                adopt(base.state[flat])
        for name, buf in zip(int8_buffer_names(self.module), int8_buffers(self.module), strict=True):
            buf.copy_(model_state[name])  # int8 base weights and scales (ZeRO-1/2), as saved
        for name, buf in expert_bias_buffers(self.module).items():
            buf.copy_(model_state[name])  # the MoE layers' expert bias (train/moe_balance.py), as saved


# ---------------------------------------------------------------- DeepSpeed's MoE conventions
#
# With expert parallelism (parallel.ep_size > 1, ZeRO-1/2: layout_rules.check_ep), DeepSpeed 0.19.8 reduces and
# partitions expert parameters apart from the dense ones only in an engine that knows it has MoE layers, which it
# learns from isinstance(module, deepspeed.moe.layer.MoE) (runtime/engine.py _configure_distributed_model). What its
# own MoE layer would set up is set up for our groups, by the three functions below, in DeepSpeedZero.__init__:
#
#   1. _register_expert_groups: our ep and edp groups under DeepSpeed's name ep_size_{ep} in deepspeed.utils.groups
#      (what MoE.set_deepspeed_parallelism creates through _create_expert_and_data_parallel); the engine then
#      broadcasts each expert within its edp group only (_broadcast_model, by the experts' allreduce = False and
#      group_name that parallel/ep/apply.py sets);
#   2. _mark_moe_model: a parameter-free subclass of DeepSpeed's MoE under model.ds_moe_marker, so the engine sets
#      has_moe_layers (ZeRO's MoE settings, stage_1_and_2.py _configure_moe_settings: stage 2 needs
#      contiguous_gradients, both need reduce_scatter, checked before launch by parallel/zero/config.py);
#   3. _moe_param_groups: each expert parameter in an optimizer group marked moe: True, which ZeRO partitions over
#      edp (real_dp_process_group).
#
# When no expert trains (LoRA, or train.freeze of every expert) 2 and 3 are skipped: DeepSpeed asserts that a model
# with MoE layers has a MoE optimizer group, and frozen experts need none (check_ep refuses a freeze that leaves
# some ep ranks, but not all, without trainable experts: ZeRO's per-group norm reductions over dp would not pair up).
# Checkpoints are then written by parameter name, experts by global index (DeepSpeedZero._state_by_name), because
# DeepSpeed's own MoE checkpoint names experts by local index per ep rank.


def _register_expert_groups(state: ParallelState) -> None:
    """Our ep / edp groups as DeepSpeed's expert groups of ``ep_size_{ep}`` (collective: every rank calls it)."""
    from deepspeed.utils import groups

    name = group_name(state.ep_size)
    alone = None
    if state.edp.size == 1:  # every rank is alone in its edp then: each creates every singleton, in rank order
        for r in range(state.world_size):
            g = dist.new_group([r])
            if r == state.rank:
                alone = g
    for table, ranks_table, axis, group in ((groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                                             state.ep, state.ep.group),
                                            (groups._EXPERT_DATA_PARALLEL_GROUP,
                                             groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, state.edp,
                                             state.edp.group or alone)):
        assert group is not None, f"no process group for the {axis.axis} axis"
        table[name] = group
        ranks_table[name] = list(axis.ranks)


def _mark_moe_model(model: nn.Module, n_experts: int, ep_size: int) -> None:
    """Attach the marker that tells DeepSpeed the model has MoE layers (point 2 above)."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertParallelMarker(DeepSpeedMoE):
        """No parameters, never called: our MoE layers run the experts; DeepSpeed reads num_experts here."""

        def __init__(self) -> None:
            nn.Module.__init__(self)  # not DeepSpeedMoE.__init__: no gate, no experts of its own
            self.num_experts, self.ep_size = n_experts, ep_size
            self.num_local_experts = n_experts // ep_size
            self.expert_group_name = group_name(ep_size)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups are ours, registered by _register_expert_groups

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("ExpertParallelMarker only marks the model for DeepSpeed; it never runs")

    set_attrs(model, ds_moe_marker=ExpertParallelMarker())


def _moe_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our (decay, no-decay) AdamW groups, named ``decay`` and ``no_decay``, with the expert parameters moved into
    DeepSpeed's MoE groups (``split_params_into_different_moe_groups_for_optimizer``)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = [{**g, "name": name} for g, name in zip(groups, ("decay", "no_decay"), strict=True)]
    return split_params_into_different_moe_groups_for_optimizer(named)
