"""The DeepSpeed ZeRO regime (Rajbhandari et al. 2019, arXiv 1910.02054): stages 1, 2 and 3, optional offload,
with Megatron tensor parallelism (and sequence parallelism) inside each data-parallel replica.

``ZeroEngine`` implements the trainer's Engine interface around ``engines/deepspeed_zero.DeepSpeedZero``:

- the model is ``build_model``'s, drawn from ``train.seed`` (the same weights as DDP's), cut into this rank's TP
  shard (``apply_tensor_parallel``) and tagged for DeepSpeed (``prepare_for_deepspeed``: Megatron's
  ``tensor_model_parallel`` on split parameters, partial TP gradients summed inside backward). ZeRO partitions
  each rank's shard over its dp replicas only, as Megatron-DeepSpeed does through the same ``mpu`` protocol.
  Under stage 3 at tp=1 the model is constructed inside ``deepspeed.zero.Init`` so each parameter is
  partitioned as soon as its module exists, and the seed's draw is replayed one module at a time
  (``parallel/zero/deepspeed.init_partitioned``): no rank ever holds the whole model; at tp > 1 the TP shard is
  partitioned by ``deepspeed.initialize`` instead (zero.Init cannot slice weights it has already partitioned);
- the optimizer is ``optim.name``'s (DeepSpeedCPUAdam when offloaded), its LR set by the Trainer; DeepSpeed's gradient
  accumulation is the number of micro-batches the Trainer passes, its clipping ``optim.grad_clip`` over every
  shard's gradients;
- checkpoints are DeepSpeed's own files inside the trainer's folder plus the TP split specs, read back with
  ``torch.load(weights_only=True)`` (``checkpoint/deepspeed_files.py``): natively for the same layout (exact
  resume), by parameter name for any other layout or regime;
- with expert parallelism (ZeRO-1/2, ``layout_rules.check_ep``) each rank keeps its experts
  (``apply_expert_parallel``, after TP) and ``DeepSpeedZero`` follows DeepSpeed's MoE conventions (expert groups,
  the MoE marker, MoE optimizer groups: ``engines/deepspeed_zero.py``); its checkpoints are then written by
  parameter name, experts by global index, as the other regimes write them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dist_trainer.config import Config
from dist_trainer.engines.base import Engine, load_start_weights, sharded_model, start_finetune
from dist_trainer.engines.deepspeed_zero import DeepSpeedZero
from dist_trainer.model import Transformer, seq2seq_inputs
from dist_trainer.parallel.parallelize import parallelize
from dist_trainer.parallel.state import ParallelState
from dist_trainer.parallel.zero.config import validate_zero_config
from dist_trainer.parallel.zero.deepspeed import DeepSpeedMpu, init_partitioned, prepare_for_deepspeed, quiet_deepspeed


class ZeroEngine(Engine):
    """DeepSpeed ZeRO stage 1/2/3 (optionally offloaded) behind the trainer's Engine interface."""

    def __init__(self, cfg: Config, state: ParallelState, device: torch.device) -> None:
        quiet_deepspeed()
        import deepspeed

        self.cfg = cfg
        self.state = state
        self.device = device
        self.stage = state.layout.zero_stage
        self.name = f"zero{self.stage}" + ("_offload" if cfg.parallel.zero_offload else "") + (
            "+tp" if state.tp_size > 1 else "")
        self.ds_config = validate_zero_config(cfg, state.dp_size, device.type)
        self.mpu = DeepSpeedMpu(state)  # collective (it may create groups): every rank, once
        self.update = self.zero = DeepSpeedZero(cfg, state, self._build_model(deepspeed), self.ds_config, self.mpu)
        self.engine, self.optimizer = self.zero.engine, self.zero.optimizer
        self.model: Transformer = self.engine.module
        # Called after each micro-batch's backward (the memory experiment reads the grads held in between).
        self.after_backward: Callable[[], None] | None = None

    def _build_model(self, deepspeed: Any) -> Transformer:
        if self.stage < 3 or self.state.tp_size > 1:
            # The seed's plain model, cut into this rank's TP shard. Under ZeRO-3 deepspeed.initialize then
            # partitions each parameter of the shard over the dp group only (runtime/zero/parameter_offload.py:258
            # _convert_to_zero_parameters -> zero.Init(module=..., data_parallel_group=mpu's)): the model is not
            # built inside zero.Init, because apply_tensor_parallel slices full weights. Each rank holds the whole
            # plain model briefly, before partitioning.
            model = sharded_model(self.cfg, self.state, self.device)
            prepare_for_deepspeed(model, self.state)
            return model
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
        start_finetune(model, self.cfg)
        # tp 1, no ep under ZeRO-3: recompute, placement
        parallelize(model, self.state.layout, self.state, self.device, freeze=self.cfg.train.freeze,
                    compile_blocks=self.cfg.train.compile)
        load_start_weights(model, self.cfg, self.state)  # each rank reads its own partition of every parameter
        return model

    # ------------------------------------------------------------------ steps

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        n = len(batches)
        if n != self.engine.gradient_accumulation_steps():
            raise RuntimeError(f"ZeroEngine got {n} micro-batches; DeepSpeed was configured for "
                               f"{self.engine.gradient_accumulation_steps()} per step")
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            # No autocast: with bf16/fp16 DeepSpeed itself holds 16-bit params and fp32 master weights.
            with self.state.dp.exchange("deepspeed forward/backward"):  # DeepSpeed's collectives, for a hang report
                loss = self.engine(batch["tokens"], batch["targets"], **seq2seq_inputs(batch))
                self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps, as DDP's loss / n
            if self.after_backward is not None:
                self.after_backward()
            if i < n - 1:
                self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter
            loss_sum += loss.detach().float()
        return loss_sum

    def optimizer_step(self, lr: float) -> torch.Tensor:
        # the boundary: reduce(-scatter), clip to gradient_clipping, Adam step, gather; the step hooks around it
        return self.zero.step(lr, self.step_hooks)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        try:
            for batch in batches:  # stage 3: DeepSpeed's module hooks gather each layer's partitions
                total += self.engine(batch["tokens"], batch["targets"], **seq2seq_inputs(batch)).float()
        finally:
            self.engine.train()
        return total

