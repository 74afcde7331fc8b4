"""Communication volume, the pipeline bubble and an estimated step time for one layout (FLOPs: ``flops.py``).

* Compute: the hardware FLOPs of the slowest pipeline stage at the profile's GEMM throughput for this rank's
  matmul shape (tokens of a micro-batch x features per TP rank; ``HardwareProfile.matmul_flops``).
* Bubble: the schedule's idle fraction (``flops.pipeline_bubble``) stretches the slowest stage's compute. On
  shared cores (a CPU profile from ``calibrate``: more ranks than cores) a stage idle in the bubble lends its
  core to the busy ones, so the step is the longer of the critical path at the unloaded speed and the work over
  the cores (``HardwareProfile.oversubscription``).
* Communication, per rank and step, per axis: what is sent, how long it takes (ring collectives: an
  all-reduce moves 2(n-1)/n of the buffer in 2(n-1) latency hops, a gather or scatter (n-1)/n in n-1), and
  which part the schedule leaves exposed. A blocking call between computations (TP's, the pipeline's transfers on
  the critical path) also waits for peers still computing or paused by the scheduler: ``sync_cost`` per call, as
  calibrated for its group size (``HardwareProfile.collective_sync``; 0 for the data-sheet profiles). The
  overlap rules follow from what waits for what:

  tp   Megatron's f/g (Shoeybi et al. 2019): 2 all-reduces of b s h forward and 2 backward per layer and
       micro-batch (under SP an all-gather + reduce-scatter pair of the same volume, Korthikanti et al. 2022;
       on gloo, which has no reduce-scatter, parallel/comm.py all-reduces and keeps a slice), 2 more per
       recomputed layer, one for the embedding and one for the LM head's input, and the vocab-parallel loss's
       two small all-reduces. Each sits between two dependent matmuls, so none overlaps: all exposed.
  pp   the activation forward and its gradient backward per micro-batch and stage boundary (b s h / t under
       SP). A stage cannot start a micro-batch before its input arrives: the transfers on the critical path,
       2 (m v + p - 1), are exposed; the rest overlap other micro-batches' compute.
  dp   DDP: the all-reduce runs in 25 MB buckets while the LAST micro-batch's backward produces them (earlier
       micro-batches accumulate under no_sync), so only what outlasts that backward, and at least the last
       bucket, is exposed. The pipeline engine all-reduces once after the schedule: exposed.
       ZeRO-1 reduces at the accumulation boundary, ZeRO-2 reduce-scatters every micro-batch's gradients
       (DeepSpeed's stage-2 hooks), both all-gather the updated partition after the step; ZeRO-3 gathers every
       parameter in each micro-batch's forward and backward and reduce-scatters its gradients (ZeRO, section
       7: 3 Psi per micro-batch). With DeepSpeed's ``overlap_comm`` (read from the JSON the run uses) the
       reductions overlap the backward that produces them and ZeRO-3's prefetch hides gathers behind the
       previous module's compute; without it (``configs/ds``' choice) they run inside the hooks: exposed. The
       all-gather after the step always is.
  offload  fp32 gradients to the host and 16-bit parameters back over PCIe (ZeRO-2 moves gradients every
       micro-batch), CPU Adam on the node's cores: between backward and the next forward: exposed.
  ep   mixture of experts under expert parallelism (planner/moe.py): per MoE layer and micro-batch the dispatch
       buffer goes to the experts' ranks and their outputs come back, two all-to-alls forward and two backward
       (two more per recomputed MoE layer), each sending (ep - 1)/ep of the buffer, inside a node when the ep
       group's ep x pp x tp consecutive ranks fit one. Each sits between two dependent computations (router ->
       experts -> combine): all exposed.
  deepspeed  what DeepSpeed's ZeRO step costs over DDP's beyond the traffic above (hooks, flat buffers, bucketed
       collectives), per parameter per step and per micro-batch: measured by ``calibrate`` (zero_overhead), 0 for
       the data-sheet profiles.
  edp  the experts' gradients, over the expert-data-parallel group (dp / ep ranks) instead of dp: one flat
       all-reduce after backward (exposed), or ZeRO-1/2's reductions and gather over edp (the dp rules).

A MoE layer costs its router, top_k experts and its shared expert per token in model FLOPs (MFU), and every
expert slot, padding included, in hardware FLOPs; its block is whole on every TP rank, so its FLOPs are not
divided by tp.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from dist_trainer.config import ModelConfig
from dist_trainer.planner.activations import recomputed_layers
from dist_trainer.planner.cp import cp_counted_bytes, cp_exposed_seconds
from dist_trainer.planner.flops import layer_forward_flops_per_token, pipeline_bubble, step_flops
from dist_trainer.planner.hardware import HardwareProfile
from dist_trainer.planner.memory import (
    DEFAULT_OPTIONS,
    Layout,
    TrainingOptions,
    rank_expert_trainable,
    rank_trainable,
)
from dist_trainer.planner.moe import (
    all_to_all_bytes,
    dispatch_elements,
    ep_link_is_intra,
    moe_flops_per_token,
    moe_layer_ids,
)
from dist_trainer.planner.rank_params import rank_params
from dist_trainer.planner.seq2seq import target_length

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
# The work between the GEMMs, counted on our layer (model.py), per token, forward + backward (backward about twice
# the forward's passes), in elements read or written: norms and residual adds over d_model (split by t only under
# SP); attention layout copies, SDPA's reads and writes and the MLP activation over the TP-split widths; the
# log-softmax and its gradient over the vocabulary (split by t). Priced only with a profile's memory_bw.
PASSES_REPLICATED = 28  # x d_model: 2 norms (2 each) + 2 residual adds (3 each) forward, ~1.8x that backward
PASSES_SPLIT = 36  # x d_model / t: q/k/v/o layout copies and SDPA I/O (12 forward, 24 backward)
PASSES_MLP = 5  # x ffn / t: the activation (2 forward, 3 backward)
PASSES_LOSS = 5  # x vocab / t: log-softmax (2 forward), its gradient (3 backward)
OPS_PER_LAYER = 55  # ops (kernels) of one layer's forward and backward on one micro-batch
OPS_PER_MICRO = 15  # embedding, final norm, head and loss, forward and backward
ADAM_BYTES = 28  # fp32 AdamW reads p, g, m, v and writes p, m, v
ADAM_OPS = 10  # ops per parameter tensor of torch's single-tensor AdamW (foreach=False); DeepSpeed's flat groups: 2


@dataclass(frozen=True)
class AxisTime:
    """One axis's traffic in a step: bytes this rank sends, seconds they take, the exposed part, and why."""

    bytes: float
    time: float
    exposed: float
    rule: str


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by component, and what it means for throughput."""

    compute: float
    bubble: float
    axes: dict[str, AxisTime]  # tp, pp, dp, offload: traffic, time, exposed part, overlap rule
    total: float
    model_flops: float
    mfu: float

    @property
    def tp_comm(self) -> float:
        return self._exposed("tp")

    @property
    def pp_comm(self) -> float:
        return self._exposed("pp")

    @property
    def dp_comm(self) -> float:
        return self._exposed("dp")

    @property
    def offload(self) -> float:
        return self._exposed("offload")

    @property
    def comm_bytes(self) -> dict[str, float]:
        return {k: a.bytes for k, a in self.axes.items()}

    def _exposed(self, axis: str) -> float:
        return self.axes[axis].exposed if axis in self.axes else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "tp_comm": self.tp_comm, "pp_comm": self.pp_comm, "dp_comm": self.dp_comm,
                "offload": self.offload}


def ring_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of one ring collective over ``n`` ranks: ``nbytes`` is the full buffer (all-reduce, the gathered
    or scattered whole) or the message (p2p)."""
    if kind == "p2p":
        return nbytes / bandwidth + latency
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency  # all_gather, reduce_scatter


def _zero_overlap_comm(layout: Layout, options: TrainingOptions) -> bool:
    """DeepSpeed's overlap_comm for this layout: the option, else the shipped configs/ds JSON (what plan writes)."""
    if options.zero_overlap_comm is not None:
        return options.zero_overlap_comm
    return _shipped_overlap_comm(layout.zero_stage, layout.zero_offload)


@functools.cache
def _shipped_overlap_comm(stage: int, offload: bool) -> bool:
    from dist_trainer.parallel.zero.config import default_ds_config_path, read_ds_json  # torch-free

    path = default_ds_config_path(stage, offload)
    if not path.is_file():  # a layout the trainer refuses (ZeRO-1 offload) priced only to say how close it comes
        return False
    zero = read_ds_json(path).get("zero_optimization")
    return bool((zero or {}).get("overlap_comm", False))


def estimate_step_time(cfg: ModelConfig, layout: Layout, *, seq_len: int, hardware: HardwareProfile,
                       gpus_per_node: int, options: TrainingOptions = DEFAULT_OPTIONS,
                       n_params_rank: int | None = None, n_trainable_rank: int | None = None,
                       n_expert_rank: int = 0, n_expert_trainable_rank: int | None = None,
                       layers_by_rank: list[list[int]] | None = None) -> StepTime:
    """Compute of the slowest stage, stretched by the bubble, plus each axis's exposed communication (module
    docstring: the overlap rules). Gradients, their reductions and the optimizer exist for the ``n_trainable_rank``
    trainable parameters only (default: those ``options.freeze`` and LoRA leave trainable on pipeline rank 0);
    ZeRO-3 gathers every parameter. Under
    expert parallelism ``n_expert_rank`` of the rank's parameters (``n_expert_trainable_rank`` trainable) are its
    experts, reduced over edp, not dp (the ep and edp axes). ``layers_by_rank``: ``layout.layers_by_rank(cfg)``,
    when the caller has it (the search prices thousands of layouts over a few stage splits)."""
    n, t, p, m, v = (layout.world_size, layout.tp_size, layout.pp_size, layout.n_microbatches,
                     layout.pp_virtual_stages)
    model_f, hw_f = step_flops(cfg, seq_len=seq_len, global_batch=layout.global_batch_size,
                               recompute=layout.activation_checkpointing, checkpoint_every=layout.checkpoint_every,
                               target_len=target_length(seq_len, options.target_len, options.source_mask)
                               if cfg.n_decoder_layers else None)
    tokens = layout.rank_tokens(seq_len)  # a micro-batch's tokens on this rank (its share of each where split)
    layers = layout.layers_by_rank(cfg) if layers_by_rank is None else layers_by_rank
    most_layers = max(len(ids) for ids in layers)
    imbalance = most_layers * p / (cfg.n_layers + cfg.n_decoder_layers)  # the slowest stage sets the pace
    rp = rank_params(cfg, tp_size=t, pp_size=p, pp_rank=0, stage_layers=layout.pp_stage_layers, virtual_stages=v,
                     balance=layout.pp_balance, ep_size=layout.ep_size) if n_params_rank is None else None
    n_rank = rp.total if rp is not None else n_params_rank
    expert = rp.expert if rp is not None else n_expert_rank  # this rank's experts under ep (their own groups)
    assert n_rank is not None
    if n_trainable_rank is not None:
        trainable = n_trainable_rank
    else:  # options.freeze and LoRA say which of the counted ones train, as the memory prediction's do
        trainable = rank_trainable(cfg, layout, rp, options, 0) if rp is not None else n_rank
    if n_expert_trainable_rank is not None:
        expert_trainable = n_expert_trainable_rank
    else:
        expert_trainable = rank_expert_trainable(cfg, layout, rp, options, 0) if rp is not None else expert
    compute = hw_f / n * imbalance / hardware.matmul_flops(options.precision, tokens, cfg.d_model / t)
    whole = t * layout.sample_split  # the ranks that compute each MoE block whole (TP's, and a split sample's)
    if whole > 1 and cfg.n_experts:  # the MoE blocks are whole on each of them: that many times their share
        _, moe_hw = moe_flops_per_token(cfg, seq_len)
        block = 3.0 * len(moe_layer_ids(cfg)) * moe_hw * layout.global_batch_size * seq_len
        compute += block * (whole - 1) / n * imbalance / hardware.matmul_flops(options.precision, tokens,
                                                                               cfg.d_model)
    compute += _memory_and_overhead(cfg, layout, options, hardware, most_layers, tokens, trainable)
    ranks_per_node = min(gpus_per_node, n)
    compute /= hardware.rank_speed(ranks_per_node)  # a CPU profile measured with another number of busy ranks
    bubble_frac = pipeline_bubble(p, m, v, layout.pp_schedule)
    # the schedule's critical path; on shared cores (oversubscription f > 1) a stage idle in the bubble lends its
    # core, the busy ones run up to f times faster, and the step is never shorter than the work over the cores
    bubble = max(0.0, compute / hardware.oversubscription(ranks_per_node) / (1 - bubble_frac) - compute)
    backward_one = compute * 2.0 / 3.0 / m  # one micro-batch's backward
    act = 4 if options.precision == "fp32" else 2
    bsh = tokens * cfg.d_model * act
    intra = (hardware.intra_node_bw, hardware.intra_node_latency)
    inter = (hardware.inter_node_bw, hardware.inter_node_latency)
    axes: dict[str, AxisTime] = {}
    if t > 1:  # a TP group stays inside a node
        recomputed = max(len(recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, ids))
                         for ids in layers)
        sp = layout.sequence_parallel
        # per micro-batch: 4 per layer, 2 per recomputed layer, the embedding's and the LM head's (one stage holds
        # each when p > 1: the last one's head is counted), in units of one all-reduce or SP's gather + scatter
        calls = (4 * most_layers + 2 * recomputed + (2 if p == 1 else 1)) * m
        per_call = (ring_time("all_gather", bsh, t, *intra) + ring_time(hardware.scatter_kind(), bsh, t, *intra)
                    if sp else ring_time("all_reduce", bsh, t, *intra))
        # the vocab-parallel loss: the row max and the (target logit, exp sum) pairs, fp32 per token
        loss = m * (ring_time("all_reduce", 4 * tokens, t, *intra) + ring_time("all_reduce", 8 * tokens, t, *intra))
        blocking = calls * (2 if sp else 1) + 2 * m  # SP: a gather and a scatter for each all-reduce
        time = calls * per_call + loss + blocking * hardware.sync_cost(t, compute / blocking)
        axes["tp"] = AxisTime(2 * (t - 1) / t * (calls * bsh + 12 * m * tokens), time, time,
                              "between dependent matmuls: all exposed")
    if layout.cp_size > 1:
        axes["cp"] = _cp_time(cfg, layout, options, hardware, seq_len=seq_len, tokens=tokens, layers=layers,
                              link=intra if t * layout.cp_size <= gpus_per_node else inter)
    if p > 1:
        msg = bsh / (t if layout.sequence_parallel else 1)
        link = intra if t * p <= gpus_per_node else inter
        critical = 2 * (m * v + p - 1)
        one = ring_time("p2p", msg, 2, *link) + hardware.sync_cost(2, compute / (2 * m * v))
        axes["pp"] = AxisTime(2 * m * v * msg, 2 * m * v * one, critical * one,
                              f"the {critical} transfers on the schedule's critical path are exposed")
    if layout.replicas > 1:
        link = inter if n > gpus_per_node else intra
        replicas = layout if layout.sample_split == 1 else replace(layout, dp_size=layout.replicas)  # their average
        axes["dp"] = _dp_time(replicas, options, n_rank - expert, trainable - expert_trainable, backward_one,
                              compute, link)
        axes.update(_expert_axes(cfg, layout, options, expert, expert_trainable, backward_one, compute, link,
                                 seq_len=seq_len,
                                 ep_link=intra if ep_link_is_intra(ep_size=layout.ep_size, tp_size=t, pp_size=p,
                                                                   gpus_per_node=gpus_per_node) else inter,
                                 layers=layers))
    if layout.zero_offload:
        # the optimizer's part: dense over dp, this rank's experts over edp (DeepSpeed's MoE groups)
        r = layout.replicas
        shard = (trainable - expert_trainable) / r + expert_trainable * layout.ep_size / r
        per_micro = m if layout.zero_stage == 2 else 1  # stage 2 moves every micro-batch's gradient partition
        transfer = shard * (4 * per_micro + options.param_bytes) / hardware.pcie_bw
        adam = shard * min(gpus_per_node, n) / hardware.host_adam_params_per_s
        axes["offload"] = AxisTime(shard * (4 * per_micro + options.param_bytes), transfer + adam,
                                   transfer + adam, "between backward and the next forward: exposed")
    if layout.zero_stage and (extra := hardware.zero_step_overhead(layout.zero_stage, trainable, m)):
        axes["deepspeed"] = AxisTime(0.0, extra, extra, "DeepSpeed's step over DDP's beyond the traffic (calibrated)")
    total = compute + bubble + sum(a.exposed for a in axes.values())
    mfu = model_f / (total * n * hardware.peak_flops(options.precision))
    return StepTime(compute=compute, bubble=bubble, axes=axes, total=total, model_flops=model_f, mfu=mfu)


def _cp_time(cfg: ModelConfig, layout: Layout, options: TrainingOptions, hardware: HardwareProfile, *, seq_len: int,
             tokens: int, layers: list[list[int]], link: tuple[float, float]) -> AxisTime:
    """The cp axis (``planner/cp.py``): ring shifts overlapped with one block of the attention core each, or the
    all-to-alls around it, exposed; on the rank with the most layers."""
    ids = max(layers, key=len)
    act = 4 if options.precision == "fp32" else 2
    _, attn = layer_forward_flops_per_token(cfg, seq_len)
    t = layout.tp_size
    attention_fwd = attn * tokens / t / hardware.matmul_flops(options.precision, tokens, cfg.d_model / t)
    recomputed = len(ids) if layout.activation_checkpointing == "selective" else len(
        recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, ids))
    total, exposed = cp_exposed_seconds(cfg, layout, seq_len=seq_len, act_bytes=act, layers=len(ids),
                                        recomputed=recomputed, attention_fwd_s=attention_fwd, link=link)
    volume = cp_counted_bytes(cfg, layout, seq_len=seq_len, precision=options.precision, layer_ids=ids)
    note = ("K/V around the ring, each shift behind one block of the attention core" if layout.cp_mode == "ring"
            else "q, k, v and the output across the group around the attention core: all exposed")
    return AxisTime(volume, total, exposed, note)


def _memory_and_overhead(cfg: ModelConfig, layout: Layout, options: TrainingOptions, hardware: HardwareProfile,
                         layers: int, tokens: int, trainable: int) -> float:
    """Seconds of the elementwise passes, the optimizer and the per-op cost of this rank's step (constants above),
    when the profile has measured them (``memory_bw``, ``op_overhead``: dist-trainer calibrate); else 0, the
    data-sheet profiles' efficiency standing for them. Every micro-batch crosses the last stage, so the loss's
    passes are on the critical path whatever the stage. The optimizer updates the ``trainable`` parameters only."""
    if hardware.memory_bw is None or hardware.op_overhead is None:
        return 0.0
    t, m, h = layout.tp_size, layout.n_microbatches, cfg.d_model
    act = 4 if options.precision == "fp32" else 2
    replicated = h / t if layout.sequence_parallel else h
    per_token = layers * (PASSES_REPLICATED * replicated + PASSES_SPLIT * h / t + PASSES_MLP * cfg.ffn_dim / t)
    recomputed = {"full": 1.0, "every_k": 1.0 / layout.checkpoint_every, "selective": 0.2}.get(
        layout.activation_checkpointing, 0.0)  # a recomputed forward: about a third of the passes again
    per_token *= 1 + recomputed / 3
    passes = m * tokens * (per_token * act + PASSES_LOSS * cfg.vocab_size / t * 4)
    optimizer_bytes = ADAM_BYTES * trainable / (layout.replicas if layout.zero_stage else 1)
    tensors = 16 * layers + 4  # a rank's parameter tensors (a GPT layer's 16 with biases; embeddings, norms)
    optimizer_ops = ADAM_OPS * (tensors if layout.zero_stage == 0 else 2)
    ops = m * (OPS_PER_LAYER * layers + OPS_PER_MICRO) + optimizer_ops
    return (passes + optimizer_bytes) / hardware.memory_bw + ops * hardware.op_overhead


def _ep_exchange(cfg: ModelConfig, layout: Layout, options: TrainingOptions,
                 layer_ids: list[int]) -> tuple[int, int, int, int]:
    """(MoE layers, recomputed MoE layers, bytes per element going out, coming back) of a rank holding
    ``layer_ids``: the buffer leaves in the residual stream's dtype and comes back in the compute dtype."""
    ids = moe_layer_ids(cfg, layer_ids)
    recomputed = len(recomputed_layers(layout.activation_checkpointing, layout.checkpoint_every, ids))
    return len(ids), recomputed, 2 if options.precision in ("bf16", "fp16") else 4, \
        4 if options.precision == "fp32" else 2


def counted_traffic(cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                    pp_rank: int) -> dict[str, tuple[str, str | None, int]]:
    """The traffic the planner counts exactly, for every run's plan check (``train/plan_check.py``): figure ->
    (axis, op or None for all of the axis's, bytes that pipeline rank hands to it in one step's forward and
    backward, as its ``AxisGroup`` counts them). One entry per axis of more than one rank that is priced so."""
    ids = layout.rank_layer_ids(cfg, pp_rank)
    out: dict[str, tuple[str, str | None, int]] = {}
    if layout.ep_size > 1 and cfg.n_experts:
        out["ep_traffic"] = ("ep", "all_to_all", ep_counted_bytes(cfg, layout, options, seq_len=seq_len,
                                                                  layer_ids=ids))
    if layout.cp_size > 1:
        out["cp_traffic"] = ("cp", None, cp_counted_bytes(cfg, layout, seq_len=seq_len, precision=options.precision,
                                                          layer_ids=ids, last_stage=pp_rank == layout.pp_size - 1))
    return out


def ep_counted_bytes(cfg: ModelConfig, layout: Layout, options: TrainingOptions, *, seq_len: int,
                     layer_ids: list[int]) -> int:
    """Bytes a rank holding ``layer_ids`` hands to its ep all-to-alls in one step: what ``comm_bytes/ep/all_to_all``
    counts (the whole buffer per call), 0 without expert parallelism. ``train/plan_check.py`` compares the two."""
    if layout.ep_size == 1 or not cfg.n_experts:
        return 0
    n_moe, recomputed, in_b, out_b = _ep_exchange(cfg, layout, options, layer_ids)
    return all_to_all_bytes(cfg, n_moe_layers=n_moe, micro_batch=layout.micro_batch_size, seq_len=seq_len,
                            n_microbatches=layout.n_microbatches, n_recomputed=recomputed, in_bytes=in_b,
                            out_bytes=out_b)


def _expert_axes(cfg: ModelConfig, layout: Layout, options: TrainingOptions, expert: int, expert_trainable: int,
                 backward_one: float, compute: float, link: tuple[float, float], *, seq_len: int,
                 ep_link: tuple[float, float], layers: list[list[int]]) -> dict[str, AxisTime]:
    """The ep (token all-to-alls) and edp (expert gradients) axes of expert parallelism (module docstring): this
    rank's ``expert`` parameters, of which ``expert_trainable`` train (frozen experts have no gradient)."""
    ep, edp = layout.ep_size, layout.dp_size // layout.ep_size
    if ep == 1 or not cfg.n_experts:
        return {}
    ids = max(layers, key=lambda x: len(moe_layer_ids(cfg, x)))
    counted = ep_counted_bytes(cfg, layout, options, seq_len=seq_len, layer_ids=ids)
    n_moe, recomputed, in_b, out_b = _ep_exchange(cfg, layout, options, ids)
    elems = dispatch_elements(cfg, micro_batch=layout.micro_batch_size, seq_len=seq_len)
    one = {b: (ep - 1) / ep * elems * b / ep_link[0] + (ep - 1) * ep_link[1] for b in (in_b, out_b)}
    calls = layout.n_microbatches * (2 * n_moe + recomputed)  # of each direction
    time = calls * (one[in_b] + one[out_b])
    axes = {"ep": AxisTime((ep - 1) / ep * counted, time, time,
                           "between the router, the experts and the combine: all exposed")}
    if edp > 1 and expert_trainable:
        if layout.zero_stage:
            axes["edp"] = _dp_time(replace(layout, dp_size=edp), options, expert, expert_trainable, backward_one,
                                   compute, link)
        else:
            grads = expert_trainable * options.grad_bytes
            t = ring_time("all_reduce", grads, edp, *link)
            axes["edp"] = AxisTime(2 * (edp - 1) / edp * grads, t, t, "one flat all-reduce after backward: exposed")
    return axes


def _dp_time(layout: Layout, options: TrainingOptions, n_rank: int, trainable: int, backward_one: float,
             compute: float, link: tuple[float, float]) -> AxisTime:
    """The data-parallel axis of one step (module docstring): volume per regime and what overlaps it. Gradients and
    ZeRO-1/2's updated partitions are the trainable parameters'; ZeRO-3 gathers every parameter for use."""
    d, m = layout.dp_size, layout.n_microbatches
    grads = trainable * options.grad_bytes
    params = (n_rank if layout.zero_stage == 3 else trainable) * options.param_bytes
    if layout.zero_stage == 0:
        time = ring_time("all_reduce", grads, d, *link)
        if layout.pp_size > 1:
            return AxisTime(2 * (d - 1) / d * grads, time, time, "one flat all-reduce after the schedule: exposed")
        last = ring_time("all_reduce", min(DDP_BUCKET_BYTES, grads), d, *link)
        return AxisTime(2 * (d - 1) / d * grads, time, max(last, time - backward_one),
                        "DDP buckets overlap the last micro-batch's backward, all but the last bucket")
    frac = (d - 1) / d
    gather = ring_time("all_gather", params, d, *link)  # the updated partition (ZeRO-1/2) or one pass (ZeRO-3)
    scatter = ring_time("reduce_scatter", grads, d, *link)
    overlap = _zero_overlap_comm(layout, options)
    if layout.zero_stage == 3:
        sent = m * frac * (2 * params + grads)
        time = m * (2 * gather + scatter)
        if not overlap:
            return AxisTime(sent, time, time, "overlap_comm off: gathers and reductions inside the hooks, exposed")
        exposed = max(0.0, m * 2 * gather - compute) + max(0.0, m * scatter - compute * 2 / 3)
        return AxisTime(sent, time, exposed, "overlap_comm: prefetched gathers and reductions behind compute")
    reductions = m if layout.zero_stage == 2 else 1
    sent = frac * (reductions * grads + params)
    time = reductions * scatter + gather
    if not overlap:
        return AxisTime(sent, time, time, "overlap_comm off: reductions inside the hooks, then the gather: exposed")
    window = backward_one * reductions
    return AxisTime(sent, time, max(0.0, reductions * scatter - window) + gather,
                    "overlap_comm: reductions behind the backward; the gather after the step exposed")
