"""Per-rank memory: parameters, gradients, optimizer states, activations, overheads; host bytes apart.

Model states follow ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, sections 3.1 and 5): with mixed precision
and Adam a rank keeps 2 Psi (16-bit params) + 2 Psi (16-bit grads) + K Psi (K = 12: fp32 master, momentum,
variance); stage 1 shards the K Psi over the DP degree, stage 2 also the gradients, stage 3 also the parameters.
Megatron-LM's distributed optimizer also keeps an fp32 copy of 16-bit gradients in the optimizer shard
(``fp32_grad_copy=True``: its README's 20 = 4 + 16 bytes per parameter for fp16 params and grads).
DeepSpeed's ZeRO optimizers instead build fp32 gradients inside ``step()``: reported as ``step_buffers``,
apart from the model states they do not own between steps (``zero_step_buffers``).
Under TP and PP the Psi above is the rank's own Psi_r (``rank_params``: its TP shard with the padded vocabulary
rows and replicated norms/biases/kv heads, its pipeline stages with the last stage's copy of a tied embedding),
and ZeRO shards it over the dp replicas only (DeepSpeed's data-parallel group is our dp axis): ZeRO-1 keeps
4 Psi_r params and grads + 12 Psi_r/dp (fp32 master + moments), ZeRO-2 4 Psi_r + 16 Psi_r/dp, ZeRO-3 16 Psi_r/dp
(fp32 model; ``tests/test_zero_tp_pp.py`` measures each rank of tp x dp, pp x dp and 3D layouts to within 1%).
Activations come from ``activations.py`` (the tensors our model saves), overheads are explicit terms.
Expert parallelism (``planner/moe.py``): a rank's experts keep their model states whole under DDP and partitioned
over the expert-data-parallel group (dp / ep ranks) under ZeRO-1/2, never in DDP's buckets.
Fine-tuning (``model.lora_rank``, ``TrainingOptions.freeze``): every parameter is held, but gradients, optimizer
states, DeepSpeed's partitions and step buffers and DDP's buckets exist for the trainable ones only
(``planner/finetune.py``), and activations keep what backward still computes.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field, fields, replace

from dist_trainer.config import ModelConfig
from dist_trainer.facts.finetune import trainable_expert_params
from dist_trainer.facts.quant_sizes import INT8_QMAPS_BYTES, adam_moment_bytes, int8_weights
from dist_trainer.layout_rules import Layout, check_low_bit, check_shape
from dist_trainer.planner import activations as act
from dist_trainer.planner.activation_costs import OFFLOADED, layer_costs, stage_activations
from dist_trainer.planner.activation_spec import ActivationSpec
from dist_trainer.planner.axes import AXES
from dist_trainer.planner.finetune import grad_plan, trainable_params
from dist_trainer.planner.loss_costs import PIPELINE_LOGITS, default_loss_chunk
from dist_trainer.planner.moe import moe_layer_ids
from dist_trainer.planner.optimizer import state_saving
from dist_trainer.planner.options import (  # re-exported: the planner's callers import them from here
    DEFAULT_OPTIONS,
    DEFAULT_OVERHEADS,
    DTYPE_BYTES,
    MOMENT_BYTES,
    OPTIMIZERS,
    Overheads,
    TrainingOptions,
)
from dist_trainer.planner.rank_params import RankParams, rank_params
from dist_trainer.planner.seq2seq import seq2seq_stage_activations, target_length

GiB = 2**30
__all__ = ["DEFAULT_OPTIONS", "DEFAULT_OVERHEADS", "DTYPE_BYTES", "GiB", "MOMENT_BYTES", "OPTIMIZERS",
           "Overheads", "RankMemory", "TrainingOptions"]


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank (device) plus the host bytes of offloaded states."""

    params: int
    grads: int
    optimizer: int
    activations: int
    overheads: int
    host: int
    step_buffers: int = 0  # optimizer-step working memory (DeepSpeed's fp32 gradient partitions)
    pp_rank: int = 0
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def saved_activations(self) -> int:
        """What the autograd graph holds (the saved-tensor-hook figure): activations less the backward working set and
        the logits a pipeline's schedule keeps (``loss_costs.pipeline_logits``)."""
        return (self.activations - self.detail.get("activations.backward_working_set", 0)
                - self.detail.get(f"activations.{PIPELINE_LOGITS}", 0))

    @property
    def device_total(self) -> int:
        return self.model_states + self.activations + self.step_buffers + self.overheads

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "model_states": self.model_states, "device_total": self.device_total}


def node_host_bytes(rank_host: int, *, world_size: int, gpus_per_node: int) -> int:
    """Host bytes of one node: each of its ranks (gpus_per_node, or the whole world when smaller) holding
    ``rank_host`` bytes of offloaded states; pass the stage with the most host bytes for an upper bound when stages
    differ."""
    return rank_host * min(gpus_per_node, world_size)


def model_state_bytes(n_params: int, *, dp_size: int = 1, zero_stage: int = 0, zero_offload: bool = False,
                      options: TrainingOptions = DEFAULT_OPTIONS, n_trainable: int | None = None,
                      int8: tuple[int, int] = (0, 0)) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, host) bytes of one rank holding ``n_params`` before DP/ZeRO sharding, of which
    ``n_trainable`` (default: all) train: frozen parameters have no gradient and no optimizer state, and DeepSpeed
    partitions (and offloads) only the trainable ones' (its optimizer sees only them). ``int8``: (weights, scales)
    among the frozen ones stored as int8 codes and scales in the parameters' dtype (``model.base_weight_dtype``:
    1 + 4/g bytes per weight in an fp32 model)."""
    options.validate()
    n_train = n_params if n_trainable is None else n_trainable
    weights, scales = int8
    assert not weights or zero_stage < 3, "int8 base weights are refused under ZeRO-3 (quant_sizes.check_int8_layout)"
    p = (n_params - weights) * options.param_bytes + weights + scales * options.param_bytes
    g = n_train * options.grad_bytes
    shard = dp_size if zero_stage >= 1 else 1
    master = 4 if zero_stage >= 1 and options.param_bytes == 4 and options.zero_fp32_master else 0
    # DeepSpeed's ZeRO optimizers keep an fp32 master copy of their partition even when the model is fp32
    # (measured: 12 bytes/param of optimizer state under ZeRO-1/2/3 with fp32 AdamW). Int8 moments add one absmax per
    # started 256-value block of the rank's partition and bitsandbytes' two shared maps.
    o = ((master + options.optimizer_bytes) * n_train) // shard + optimizer_scale_bytes(n_train // shard, options)
    if zero_stage >= 2:
        g //= shard
    if zero_stage >= 3:
        p //= shard
    host = 0
    if zero_offload:
        # DeepSpeed's CPU Adam keeps the optimizer partition and an fp32 gradient partition in host memory.
        host, o = o + 4 * n_train // shard, 0
        if zero_stage >= 2:
            g = 0  # reduced gradients stream to the host partition; the GPU keeps only buckets
        if zero_stage == 3:
            host, p = host + p, 0
    return p, g, o, host


def optimizer_scale_bytes(n: int, options: TrainingOptions) -> int:
    """The optimizer bytes beyond K per value of ``n`` trainable values on a rank (a ZeRO partition, or the rank's
    tensors): with int8 moments, one fp32 absmax per started 256-value block per moment
    (``quant.sizes.adam_moment_bytes``; counted over the total, so at most 8 bytes per tensor under the true
    per-tensor count) and bitsandbytes' two shared quantisation maps; 0 otherwise."""
    if options.optim_state_dtype != "int8" or options.optimizer not in ("adam", "adamw") or not n:
        return 0
    return adam_moment_bytes(n, "int8") - MOMENT_BYTES["int8"] * n + INT8_QMAPS_BYTES


def layout_rank_params(cfg: ModelConfig, layout: Layout, pp_rank: int) -> RankParams:
    """The parameters pipeline rank ``pp_rank`` of ``layout`` holds (every TP and DP rank of it the same)."""
    return rank_params(cfg, tp_size=layout.tp_size, pp_size=layout.pp_size, pp_rank=pp_rank,
                       stage_layers=layout.pp_stage_layers, virtual_stages=layout.pp_virtual_stages,
                       balance=layout.pp_balance, ep_size=layout.ep_size)


def zero_step_buffers(n_params: int, layout: Layout, options: TrainingOptions, overheads: Overheads) -> dict[str, int]:
    """The fp32 gradients DeepSpeed's ZeRO optimizers build on the device inside ``step()`` (none with offload:
    the CPU optimizer keeps a persistent fp32 gradient partition in host memory, counted in ``host``).

    File:line references are to the installed DeepSpeed 0.19.8 (runtime/zero/):
    * ZeRO-1/2, ``stage_1_and_2.py`` step() :3107-3141: per parameter group, the flat gradient partition
      ``.to(fp32)`` (:3118), kept until the group's Adam step is done: 4 Psi/N. DeepSpeed's estimator counts it
      since PR #5099 (``2 Psi + 18 Psi/N``). A 16-bit model that accumulates gradients in fp32 reads its
      pre-flattened fp32 partition in place (:2904-2909, :1259-1266): nothing built. DeepSpeed goes one parameter
      group at a time, so with several groups (our AdamW's decay / no-decay) the true figure is the largest
      group's: 4 Psi/N is the one-group figure and an upper bound;
    * ZeRO-3, ``stage3.py`` step() :2873-2921: per sub-group of at most ``sub_group_size`` partition elements
      (:1210-1233, default 1e9), ``flatten(averaged_gradients).to(fp32)`` (:2686), released after its step:
      4 min(Psi/N, sub_group_size) on top of the 16 Psi/N of the model states.
    """
    if options.fp32_grad_copy is not None or layout.zero_stage == 0 or layout.zero_offload:
        return {}
    shard = n_params // layout.replicas
    if layout.zero_stage == 3:
        return {"zero3_fp32_subgroup_grad": 4 * min(shard, overheads.zero_sub_group_elements)}
    if options.grad_bytes == 4 and options.param_bytes == 2:
        return {}
    return {"zero_fp32_grad_partition": 4 * shard}


def stage_activation_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int, options: TrainingOptions,
                           pp_rank: int, expert_rows: float | None = None) -> dict[str, int]:
    """Activation terms of one rank: saved tensors at the peak, the recompute working set, autocast weight copies
    (``expert_rows``: a dropless MoE layer's rows per token on this rank's experts; None: the balanced top_k)."""
    spec = replace(activation_spec(layout, seq_len, options), moe_expert_rows=expert_rows)
    if cfg.encoder_decoder:
        return seq2seq_activation_bytes(cfg, layout, spec, options, pp_rank, in_flight_of(layout, pp_rank))
    costs = layer_costs(cfg, spec, grad_plan(cfg, options.freeze))
    return stage_activations(costs, mode=layout.activation_checkpointing, every=layout.checkpoint_every,
                             layer_ids=layout.rank_layer_ids(cfg, pp_rank),
                             tokens=layout.rank_tokens(seq_len), first=pp_rank == 0,
                             last=pp_rank == layout.pp_size - 1,
                             in_flight=in_flight_of(layout, pp_rank), offload=layout.activation_offload)


def op_kept_bytes(cfg: ModelConfig, layout: Layout, *, seq_len: int, options: TrainingOptions, pp_rank: int) -> int:
    """What op-level recomputation keeps beyond full recomputation's layer inputs on ``pp_rank`` (0 under another
    mode): the kept matmul and attention-kernel outputs, which live in the policy's cache (``model_recompute``),
    where no saved-tensor hook sees them. The two modes' saved bytes differ in those alone."""
    if layout.activation_checkpointing != "op":
        return 0
    full = layout.derive(activation_checkpointing="full", checkpoint_every=1)
    return (stage_activation_bytes(cfg, layout, seq_len=seq_len, options=options, pp_rank=pp_rank)["saved"]
            - stage_activation_bytes(cfg, full, seq_len=seq_len, options=options, pp_rank=pp_rank)["saved"])


def activation_spec(layout: Layout, seq_len: int, options: TrainingOptions) -> ActivationSpec:
    """What decides one rank's saved tensors under ``layout``: every layout field the spec declares (its TP shard,
    SP, how the sequence is split, ...), the precision and the kernel."""
    return ActivationSpec(seq_len=seq_len, precision=options.precision, attention_kernel=options.attention_kernel,
                              device=options.device, sp_saves_gathered_input=options.sp_saves_gathered_input,
                              documents=options.document_masking,
                              **{name: getattr(layout, name) for name in _SPEC_LAYOUT_FIELDS})


_SPEC_LAYOUT_FIELDS = sorted({f.name for f in fields(ActivationSpec)} & {f.name for f in fields(Layout)})
_spec_fields = operator.attrgetter(*_SPEC_LAYOUT_FIELDS)


def spec_fields(layout: Layout) -> tuple[object, ...]:
    """The Layout fields ``activation_spec`` reads, in a fixed order: what decides a rank's activation costs (a
    cache key for the search)."""
    got = _spec_fields(layout)
    return got if isinstance(got, tuple) else (got,)


def seq2seq_activation_bytes(cfg: ModelConfig, layout: Layout, spec: ActivationSpec, options: TrainingOptions,
                             pp_rank: int, in_flight: float) -> dict[str, int]:
    """``stage_activation_bytes`` of an encoder-decoder (``planner/seq2seq.py``): the source's and the target's
    tokens, the rank's stages of either stack."""
    ids = layout.rank_layer_ids(cfg, pp_rank)
    return seq2seq_stage_activations(cfg, spec, mode=layout.activation_checkpointing, every=layout.checkpoint_every,
                                     layer_ids=ids, batch=layout.micro_batch_size,
                                     target_len=target_length(spec.seq_len, options.target_len, options.source_mask),
                                     padded=options.source_mask,
                                     first=pp_rank == 0, last=pp_rank == layout.pp_size - 1, in_flight=in_flight,
                                     encoder_last=cfg.n_layers - 1 in ids)


def with_loss_chunk(cfg: ModelConfig, layout: Layout, *, seq_len: int, options: TrainingOptions) -> ModelConfig:
    """``cfg`` with the ``model.loss_chunk_tokens`` the planner chooses for ``layout``
    (``loss_costs.default_loss_chunk``) where it leaves it at 0; a set value is kept. An encoder-decoder keeps its
    own (its loss's tokens are the decoder's)."""
    if cfg.loss_chunk_tokens or cfg.encoder_decoder:
        return cfg
    chunk = default_loss_chunk(cfg, activation_spec(layout, seq_len, options), layout.rank_tokens(seq_len))
    return replace(cfg, loss_chunk_tokens=chunk) if chunk else cfg


def in_flight_of(layout: Layout, pp_rank: int) -> float:
    if layout.pp_size == 1:
        return 1.0  # gradient accumulation runs one micro-batch's forward and backward at a time
    return act.in_flight_microbatches(layout.pp_schedule, pp_size=layout.pp_size, pp_rank=pp_rank,
                                      n_microbatches=layout.n_microbatches, virtual_stages=layout.pp_virtual_stages)


def rank_memory(cfg: ModelConfig, layout: Layout, rp: RankParams, activations: dict[str, int], *,
                seq_len: int, options: TrainingOptions, overheads: Overheads, pp_rank: int,
                ep_rank: int | None = None) -> RankMemory:
    """Assemble one rank's memory from its parameter count and activation terms (shared by the search);
    ``ep_rank``: which experts it holds when fine-tuning freezes some (None: the ep rank that trains the most)."""
    return with_activations(rank_states(cfg, layout, rp, seq_len=seq_len, options=options, overheads=overheads,
                                        pp_rank=pp_rank, ep_rank=ep_rank), activations, overheads)


def rank_states(cfg: ModelConfig, layout: Layout, rp: RankParams, *, seq_len: int, options: TrainingOptions,
                overheads: Overheads, pp_rank: int, ep_rank: int | None = None) -> RankMemory:
    """``rank_memory`` without the activations and the fragmentation they add to: the model states, step buffers,
    host bytes and buffers, the same for every recomputation mode (the search computes it once for them)."""
    trainable = rank_trainable(cfg, layout, rp, options, pp_rank, ep_rank)
    expert = rank_expert_trainable(cfg, layout, rp, options, pp_rank, ep_rank)  # its trainable experts under ep
    int8 = (int8_weights(cfg, options.freeze, layout.tp_size, layout.rank_layer_ids(cfg, pp_rank))
            if cfg.base_weight_dtype == "int8" else (0, 0))  # the search asks this of every candidate
    p, g, o, host = model_state_bytes(rp.total - rp.expert, dp_size=layout.replicas, zero_stage=layout.zero_stage,
                                      zero_offload=layout.zero_offload, options=options, n_trainable=trainable - expert,
                                      int8=int8)
    # an entry with a fallback (Muon): its own states on the matrices it takes, the fallback's charged above
    o -= state_saving(cfg, layout, options, pp_rank) // (layout.replicas if layout.zero_stage else 1)
    if rp.expert:  # this rank's experts: ZeRO partitions them over edp (DeepSpeed's MoE groups)
        states = model_state_bytes(rp.expert, dp_size=layout.dp_size // layout.ep_size, zero_stage=layout.zero_stage,
                                   zero_offload=layout.zero_offload, options=options, n_trainable=expert)
        p, g, o, host = (a + b for a, b in zip((p, g, o, host), states))
        if options.optim_state_dtype == "int8" and expert and trainable - expert:
            o -= INT8_QMAPS_BYTES  # one optimizer, its two maps counted once
    offloaded_states = host  # ZeRO-Offload's optimizer partition (and ZeRO-3's parameters) in host memory
    # what ZeRO partitions, in dp-sized shares: the experts' partitions are over edp = dp / ep, ep times larger
    per_dp = trainable - expert + expert * layout.ep_size
    detail: dict[str, int] = {}
    if cfg.n_experts and cfg.expert_bias:  # each MoE layer's expert bias: a buffer, whole on every rank
        detail["params.expert_bias"] = len(moe_layer_ids(cfg, layout.rank_layer_ids(cfg, pp_rank))) * \
            cfg.n_experts * options.param_bytes
        p += detail["params.expert_bias"]
    if int8[0]:  # what the params term holds of int8 base weights (facts/quant_sizes.py)
        detail.update({"params.int8_weights": int8[0], "params.int8_scales": int8[1] * options.param_bytes})
    if options.optim_state_dtype == "int8" and trainable:  # within the optimizer term: the int8 moments' scales
        detail["optimizer.int8_scales"] = optimizer_scale_bytes(
            (trainable - expert) // (layout.replicas if layout.zero_stage else 1), options)
    if layout.zero_offload and layout.zero_stage in (1, 2) and layout.n_microbatches > 1 and trainable:
        # accumulating over micro-batches, offloaded ZeRO-1/2 keep each partition parameter's gradient in host
        # memory in the parameters' dtype (stage_1_and_2.py:1822-1853): Psi/N, plus the parameters that straddle
        # a partition boundary (kept whole); frozen parameters have no gradient
        detail["host.offload_grad_accumulation"] = per_dp * options.grad_bytes // layout.replicas
        host += detail["host.offload_grad_accumulation"]
    step = zero_step_buffers(per_dp, layout, options, overheads)
    detail.update({f"step_buffers.{k}": v for k, v in step.items()})
    over: dict[str, int] = {}
    if options.device == "cuda":
        over["cuda_context"] = overheads.cuda_context
    for axis in AXES:  # each axis entry's buffers (DDP's and DeepSpeed's buckets, the pipeline's receive buffers)
        over.update(axis.memory(cfg, layout, rp, seq_len=seq_len, options=options, overheads=overheads,
                                trainable=trainable, expert=expert))
    detail.update({f"overheads.{k}": v for k, v in over.items()})
    host = round(host * overheads.host_buffer_factor)
    if options.async_save:
        # train.async_save: the saving rank's parameters and optimizer state (ZeRO: its partitions, offloaded or
        # not) staged in host memory, one copy reused from save to save (checkpoint/async_save.py HostStager)
        detail["host.async_save_staging"] = p + o + offloaded_states
        host += detail["host.async_save_staging"]
    return RankMemory(params=p, grads=g, optimizer=o, activations=0, overheads=sum(over.values()),
                      host=host, step_buffers=sum(step.values()), pp_rank=pp_rank, detail=detail)


def with_activations(states: RankMemory, activations: dict[str, int], overheads: Overheads) -> RankMemory:
    """``states`` (``rank_states``) with the activation terms and the allocator's fragmentation over both."""
    act_total = sum(v for k, v in activations.items() if k != OFFLOADED)  # offloaded ones are host bytes
    frag = round(overheads.fragmentation * (states.model_states + act_total + states.step_buffers))
    detail = {**{f"activations.{k}": v for k, v in activations.items()}, **states.detail,
              "overheads.fragmentation": frag}
    return RankMemory(params=states.params, grads=states.grads, optimizer=states.optimizer, activations=act_total,
                      overheads=states.overheads + frag, host=states.host + activations.get(OFFLOADED, 0),
                      step_buffers=states.step_buffers,
                      pp_rank=states.pp_rank, detail=detail)


def rank_trainable(cfg: ModelConfig, layout: Layout, rp: RankParams, options: TrainingOptions, pp_rank: int,
                   ep_rank: int | None = None) -> int:
    """The trainable parameters among ``rp`` (pipeline rank ``pp_rank``, expert-parallel rank ``ep_rank``, None: the
    one that trains the most): all unless fine-tuning freezes some."""
    if not cfg.lora_rank and not options.freeze:
        return rp.total
    return trainable_params(cfg, options.freeze, tp_size=layout.tp_size, layer_ids=layout.rank_layer_ids(cfg, pp_rank),
                            first=pp_rank == 0, last=pp_rank == layout.pp_size - 1, pp_size=layout.pp_size,
                            ep_size=layout.ep_size, ep_rank=ep_rank)


def rank_expert_trainable(cfg: ModelConfig, layout: Layout, rp: RankParams, options: TrainingOptions,
                          pp_rank: int, ep_rank: int | None = None) -> int:
    """The trainable ones among ``rp.expert`` (this rank's experts under expert parallelism; 0 at ep_size 1)."""
    if not rp.expert or (not cfg.lora_rank and not options.freeze):
        return rp.expert
    return trainable_expert_params(cfg, options.freeze, layer_ids=layout.rank_layer_ids(cfg, pp_rank),
                                   ep_size=layout.ep_size, ep_rank=ep_rank)


def predict_all_stages(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                       options: TrainingOptions = DEFAULT_OPTIONS,
                       overheads: Overheads = DEFAULT_OVERHEADS, ep_rank: int | None = None) -> list[RankMemory]:
    """One RankMemory per pipeline stage (every TP and DP rank of a stage holds the same bytes, but for the experts
    fine-tuning freezes on some ep ranks only: ``ep_rank``'s, None: the ep rank that trains the most)."""
    cfg.validate()
    check_shape(cfg, layout)
    options.validate()
    check_low_bit(cfg, options.freeze, tp_size=layout.tp_size, zero_stage=layout.zero_stage,
                  zero_offload=layout.zero_offload, ep_size=layout.ep_size, state_dtype=options.optim_state_dtype)
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds model.max_seq_len={cfg.max_seq_len}")
    out = []
    for r in range(layout.pp_size):
        rp = layout_rank_params(cfg, layout, r)
        acts = stage_activation_bytes(cfg, layout, seq_len=seq_len, options=options, pp_rank=r)
        mem = rank_memory(cfg, layout, rp, acts, seq_len=seq_len, options=options, overheads=overheads,
                          pp_rank=r, ep_rank=ep_rank)
        out.append(with_dropless_peak(cfg, layout, mem, seq_len=seq_len, options=options))
    return out


def with_dropless_peak(cfg: ModelConfig, layout: Layout, mem: RankMemory, *, seq_len: int,
                       options: TrainingOptions) -> RankMemory:
    """``mem`` (priced at the balanced expectation: top_k rows per token on every rank's experts) naming, for a
    dropless MoE stage, its activations and device total when every routed row it can receive comes to its experts
    (``activations.dropless_peak_rows``): the worst case, which no layout choice bounds."""
    if not cfg.n_experts or not cfg.dropless or not moe_layer_ids(cfg, layout.rank_layer_ids(cfg, mem.pp_rank)):
        return mem
    peak = stage_activation_bytes(cfg, layout, seq_len=seq_len, options=options, pp_rank=mem.pp_rank,
                                  expert_rows=act.dropless_peak_rows(cfg, layout.ep_size))
    extra = sum(peak.values()) - mem.activations
    detail = {**mem.detail, "worst_case.dropless_activations": mem.activations + extra,
              "worst_case.dropless_device_total": mem.device_total + extra}
    return replace(mem, detail=detail)


def predict_rank_memory(cfg: ModelConfig, layout: Layout, *, seq_len: int,
                        options: TrainingOptions = DEFAULT_OPTIONS, overheads: Overheads = DEFAULT_OVERHEADS,
                        pp_rank: int | None = None, ep_rank: int | None = None) -> RankMemory:
    """Bytes on a rank of stage ``pp_rank``; None = the stage with the largest device total (``ep_rank``:
    ``predict_all_stages``)."""
    stages = predict_all_stages(cfg, layout, seq_len=seq_len, options=options, overheads=overheads, ep_rank=ep_rank)
    if pp_rank is not None:
        if not 0 <= pp_rank < layout.pp_size:
            raise ValueError(f"pp_rank={pp_rank} must be in [0, {layout.pp_size})")
        return stages[pp_rank]
    return max(stages, key=lambda m: m.device_total)
