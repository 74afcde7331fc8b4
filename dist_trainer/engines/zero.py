"""The DeepSpeed ZeRO regime (Rajbhandari et al. 2019, arXiv 1910.02054): stages 1, 2 and 3, optional offload.

``ZeroEngine`` implements the trainer's Engine interface around ``deepspeed.initialize``:

- the model is ``build_model``'s, drawn from ``train.seed`` (the same weights as DDP's); under stage 3 it is
  constructed inside ``deepspeed.zero.Init`` so each parameter is partitioned as soon as its module exists, and
  the seed's draw is replayed one module at a time (``parallel/zero/deepspeed.init_partitioned``): no rank ever
  holds the whole model;
- the optimizer is our AdamW over ``train.optim.param_groups`` (torch's, ``foreach=False``, for exact parity
  with DDP; DeepSpeedCPUAdam in AdamW mode when the optimizer is offloaded), its LR set by the Trainer;
- DeepSpeed's gradient accumulation is the number of micro-batches the Trainer passes, its clipping
  ``optim.grad_clip``; its data-parallel group is our ParallelState's (handed over through ``mpu``);
- checkpoints are DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` inside the trainer's folder
  (exact resume); ``parallel/zero/consolidate.py`` merges them by parameter name for every other reader;
- with expert parallelism (ZeRO-1/2 only, ``layout_rules.check_ep``) DeepSpeed's MoE conventions apply
  (``parallel/ep/zero.py``: expert groups, the MoE marker, MoE optimizer groups) and checkpoints are written by
  parameter name, experts by global index, as the other regimes write them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dist_trainer.checkpoint.convert import load_shards, optimizer_state_by_name
from dist_trainer.config import Config
from dist_trainer.engines.base import Engine, seeded_model, write_named_shards
from dist_trainer.model import Transformer
from dist_trainer.optim import build_optimizer, param_groups, set_lr
from dist_trainer.parallel.ep.apply import apply_expert_parallel
from dist_trainer.parallel.ep.zero import mark_moe_model, moe_param_groups, register_expert_groups, state_by_name
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.tp.reshard import tp_shard_specs
from dist_trainer.parallel.zero.config import engine_config, validate_zero_config
from dist_trainer.parallel.zero.deepspeed import DeepSpeedMpu, init_partitioned, quiet_deepspeed
from dist_trainer.parallel.zero.memory import zero_owned_bytes

DS_TAG = "deepspeed"  # DeepSpeed's checkpoint tag: the sub-folder of the trainer's step folder


class ZeroEngine(Engine):
    """DeepSpeed ZeRO stage 1/2/3 (optionally offloaded) behind the trainer's Engine interface."""

    def __init__(self, cfg: Config, state: ParallelState, device: torch.device) -> None:
        quiet_deepspeed()
        import deepspeed

        self.cfg = cfg
        self.state = state
        self.device = device
        self.stage = cfg.parallel.zero_stage
        self.name = f"zero{self.stage}" + ("_offload" if cfg.parallel.zero_offload else "")
        self.ds_config = validate_zero_config(cfg, state.dp_size, device.type)
        self.mpu = DeepSpeedMpu(state)  # collective (it may create groups): every rank, once
        model = self._build_model(deepspeed)
        if state.ep_size > 1:  # DeepSpeed's MoE conventions for our expert-parallel layers
            apply_expert_parallel(model, state)
            register_expert_groups(state)
            mark_moe_model(model, cfg.model.n_experts, state.ep)
        groups = param_groups(model, cfg.optim.weight_decay)  # full shapes decide decay under ZeRO-3
        if state.ep_size > 1:
            groups = moe_param_groups(groups)
        if cfg.parallel.zero_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                         eps=cfg.optim.eps, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                          eps=cfg.optim.eps, foreach=False)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=engine_config(self.ds_config), mpu=self.mpu,
            dist_init_required=False)
        self.model: Transformer = self.engine.module
        # Called after each micro-batch's backward (the memory experiment reads the grads held in between).
        self.after_backward: Callable[[], None] | None = None

    def _build_model(self, deepspeed: Any) -> Transformer:
        if self.stage < 3:
            return seeded_model(self.cfg).to(self.device)
        torch.manual_seed(self.cfg.train.seed)
        # zero.Init reads only the zero_optimization section; its batch assertion would use the world size
        # before our mpu is consulted, so the batch keys stay with deepspeed.initialize.
        # No dtype argument: Init._set_dtype in 0.19.8 reads ``dtype or fp16 if fp16_supported else bf16 if
        # <bound method, always true> ...``, so on CPU an explicit float32 becomes bfloat16; with dtype=None it
        # takes the precision from the config's bf16/fp16 sections instead.
        init_config = {"zero_optimization": self.ds_config["zero_optimization"],
                       "train_micro_batch_size_per_gpu": self.cfg.parallel.micro_batch_size,
                       "bf16": self.ds_config["bf16"], "fp16": self.ds_config["fp16"]}
        with deepspeed.zero.Init(data_parallel_group=self.mpu.get_data_parallel_group(),
                                 config_dict_or_path=init_config,
                                 remote_device="cpu" if self.cfg.parallel.zero_offload else None, mpu=self.mpu):
            model = Transformer(self.cfg.model)
        init_partitioned(model)
        model.set_activation_checkpointing(self.cfg.parallel.activation_checkpointing,
                                           self.cfg.parallel.checkpoint_every)
        return model.to(self.device)

    # ------------------------------------------------------------------ steps

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        n = len(batches)
        if n != self.engine.gradient_accumulation_steps():
            raise RuntimeError(f"ZeroEngine got {n} micro-batches; DeepSpeed was configured for "
                               f"{self.engine.gradient_accumulation_steps()} per step")
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            # No autocast: with bf16/fp16 DeepSpeed itself holds 16-bit params and fp32 master weights.
            loss = self.engine(batch["tokens"], batch["targets"])
            self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps, as DDP's loss / n
            if self.after_backward is not None:
                self.after_backward()
            if i < n - 1:
                self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter
            loss_sum += loss.detach().float()
        return loss_sum

    def optimizer_step(self, lr: float) -> torch.Tensor:
        set_lr(self.optimizer, lr)  # ZeRO's wrapper shares the client optimizer's param_groups
        self.engine.step()  # the boundary: reduce(-scatter), clip to gradient_clipping, Adam step, gather
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else float(norm))

    @torch.no_grad()
    def eval_loss(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        try:
            for batch in batches:  # stage 3: DeepSpeed's module hooks gather each layer's partitions
                total += self.engine(batch["tokens"], batch["targets"]).float()
        finally:
            self.engine.train()
        return total

    def owned_state_bytes(self) -> dict[str, int]:
        return zero_owned_bytes(self.optimizer, list(self.model.parameters()), self.stage)

    # ------------------------------------------------------------------ checkpoints

    def save_shards(self, folder: Path) -> dict[str, Any]:
        if self.state.ep_size > 1:  # by name, as the other regimes (gathered over each parameter's group)
            weights, moments = state_by_name(self.model, self.optimizer)
            groups = optimizer_state_by_name(self.model, build_optimizer(self.model, self.cfg.optim))["param_groups"]
            if self.state.edp.rank == 0:
                write_named_shards(folder, self.state, self.model, weights, {"state": moments, "param_groups": groups})
            return {}
        # Every rank writes its own partition (DeepSpeed's zero_pp_rank_* files) under folder/DS_TAG.
        self.engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)
        return {"zero_stage": self.stage, "zero_offload": self.cfg.parallel.zero_offload, "deepspeed_tag": DS_TAG}

    def load_shards(self, folder: Path, meta: dict[str, Any]) -> None:
        tag = meta.get("deepspeed_tag")
        if tag is None:  # a DDP/TP/single-process checkpoint starts this ZeRO run
            self._load_plain(folder, meta)
            return
        path, _ = self.engine.load_checkpoint(str(folder), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"DeepSpeed found no checkpoint {tag!r} in {folder}")

    def _load_plain(self, folder: Path, meta: dict[str, Any]) -> None:
        """Weights and AdamW moments by name (merged from any tp size) into DeepSpeed's partitions.

        DeepSpeed's fragment API (deepspeed.utils.safe_set_full_*) writes each full tensor's slice into this
        rank's fp32 master and optimizer-state partitions; the torch AdamW state over the flat partitions is
        created first (it is lazy) with the saved step count.
        """
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state


        model_state, optim_state = load_shards(folder, meta, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                               specs_now=tp_shard_specs(self.model), ep_size=self.state.ep_size)
        saved = optim_state["state"]
        missing = [n for n, _ in self.model.named_parameters() if n not in model_state]
        if missing:
            raise ValueError(f"checkpoint {folder} lacks parameters {missing[:5]}")
        step = next((s["step"] for s in saved.values()), torch.tensor(0.0))
        base = self.optimizer.optimizer
        # Stage 3 attaches its flat fp32 partitions to the torch optimizer only around step() (stage3.py
        # _set_fp32_optimizer_param_groups); stages 1/2 keep them in param_groups.
        flats = list(self.optimizer.fp32_partitioned_groups_flat) if self.stage == 3 else \
            [flat for group in base.param_groups for flat in group["params"]]
        for flat in flats:
            base.state[flat] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                                "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):  # stages 1/2 link fragments lazily
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()
        for name, p in self.model.named_parameters():
            full = model_state[name].to(self.device, torch.float32)
            safe_set_full_fp32_param(p, full)
            for key in ("exp_avg", "exp_avg_sq"):
                if name in saved:
                    safe_set_full_optimizer_state(p, saved[name][key].to(self.device, torch.float32), key)
            if self.stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(full)
            else:
                p.data.copy_(full)
