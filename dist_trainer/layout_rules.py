"""Which layouts run: the one owner of every layout rule, torch-free.

The planner's search asks it which layouts to rank, the trainer's pre-launch check asks it
whether a config runs, before any process group exists; both get the same answer, so the
planner ranks exactly the layouts the trainer accepts (``tests/test_layout_rules.py``
enumerates layouts and checks the two agree). Pure arithmetic on the config: no torch.

    regime_of           the engine a layout runs under (engines/__init__.py maps it to a class)
    check_tp            TP against the model: heads, MLP width, vocabulary shards (padded)
    layers_per_stage    the pipeline split: even by layers, by parameters, or given per stage
    check_schedule      a pipelining schedule against its micro-batches and virtual stages
    check_composition   which regimes compose (ZeRO-1/2/3 with TP, ZeRO-1 with PP; the rest refused, with why)
    check_ep            expert parallelism: a MoE model, ep dividing the experts and dp, which ZeRO stages take it
    check_precision     device limits: fp16 loss scaling needs CUDA
    check_layout        all of the above for a run config on a world size: the pre-launch check
    check_nodes         a world of several nodes fills whole ones; TP groups inside a node
    rank_grid           the (dp, pp, tp) grid of ranks, tp fastest (a TP group stays in a node)
    expert_groups       the expert-parallel and expert-data-parallel groups inside the dp axis
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dist_trainer.config import PP_BALANCES, PP_SCHEDULES, Config, ModelConfig, ParallelConfig
from dist_trainer.finetune import trainable_expert_params
from dist_trainer.layout_seq2seq import seq2seq_stage_counts
from dist_trainer.model_shape import embedding_params, layer_param_counts, padded_vocab, tail_params

REGIMES = ("ddp", "pipeline", "zero")  # engines/__init__.py holds one engine per name
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several model chunks per pipeline rank


def regime_of(parallel: ParallelConfig) -> str:
    """The regime that runs this layout: pipeline stages (with ZeRO-1 over their dp replicas when zero_stage is 1),
    DeepSpeed ZeRO, or DDP (each with TP inside)."""
    if parallel.pp_size > 1:
        return "pipeline"
    if parallel.zero_stage > 0:
        return "zero"
    return "ddp"


def needs_process_group(parallel: ParallelConfig) -> bool:
    """Whether the layout needs torch.distributed even on one process (DeepSpeed's engine does)."""
    return parallel.zero_stage > 0


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (the sizes a group of ``n`` can split into); none for ``n`` < 1.

    By trial up to sqrt(n), each small divisor giving its partner: 10**6 trials for n = 10**12, where trying every
    integer up to n ran for hours (issue 28)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


# ---------------------------------------------------------------- tensor parallelism


def check_tp(model: ModelConfig, tp_size: int) -> None:
    """Raise ValueError if ``model`` cannot be split over ``tp_size`` ranks the Megatron way.

    Query heads and the MLP width are split, so tp divides them; k/v heads never fail (when tp
    does not divide n_kv_heads they are replicated); the vocabulary is padded to a multiple of
    tp, and every rank's shard must hold real rows.
    """
    if tp_size < 1:
        raise ValueError(f"parallel.tp_size={tp_size} must be >= 1")
    if model.n_heads % tp_size:
        raise ValueError(
            f"model.n_heads={model.n_heads} is not divisible by parallel.tp_size={tp_size}: "
            f"attention heads are split across TP ranks; valid tp_size: {divisors(model.n_heads)}"
        )
    if model.ffn_dim % tp_size:
        raise ValueError(
            f"the MLP width (model.d_ff={model.ffn_dim}) is not divisible by parallel.tp_size={tp_size}; "
            f"valid tp_size: {[d for d in divisors(model.ffn_dim) if model.n_heads % d == 0]}"
        )
    local_vocab = padded_vocab(model.vocab_size, tp_size) // tp_size
    if (tp_size - 1) * local_vocab >= model.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} padded to a multiple of parallel.tp_size={tp_size} "
            f"leaves TP rank {tp_size - 1} with padding rows only ({local_vocab} rows per rank); "
            f"use a tp_size whose vocabulary shards all hold real tokens (vocab_size >= tp_size*(rows-1)+1)"
        )


# ---------------------------------------------------------------- pipeline stages


def layers_per_stage(model: ModelConfig, num_stages: int, balance: str = "layers",
                     stage_layers: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Contiguous layer counts per stage (each >= 1) summing to n_layers.

    ``stage_layers``: given explicitly (uneven splits). ``layers``: as even as possible, the
    remainder going to the middle stages first (the first and last also hold the embeddings and
    the head). ``params``: minimise the largest stage's parameter count, embeddings and head
    included (exact DP over the cut points; counts from model_shape.py, which equal the
    model's). The trainer builds these stages and the planner prices them. An encoder-decoder's split (over both
    stacks, encoder stages first) is ``layout_seq2seq.seq2seq_stage_counts``.
    """
    if model.encoder_decoder:
        if balance not in PP_BALANCES:
            raise ValueError(f"parallel.pp_balance={balance!r} is not one of {', '.join(PP_BALANCES)}")
        return seq2seq_stage_counts(model, num_stages, balance, stage_layers)
    n = model.n_layers
    if stage_layers is not None:
        counts = list(stage_layers)
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"parallel.pp_stage_layers={counts} must list {num_stages} layer counts (pp_size x virtual stages), "
                f"each >= 1, summing to model.n_layers={n}"
            )
        return counts
    if balance not in PP_BALANCES:
        raise ValueError(f"parallel.pp_balance={balance!r} is not one of {', '.join(PP_BALANCES)}")
    if n < num_stages:
        raise ValueError(
            f"model.n_layers={n} is fewer than the {num_stages} pipeline stages (pp_size x virtual stages); "
            f"use at most {n} stages or a deeper model"
        )
    if balance == "layers":
        base, extra = divmod(n, num_stages)
        # extra layers go to the middle stages first: the ends also run the embeddings and the head
        order = [*range(1, num_stages - 1), num_stages - 1, 0][:num_stages] if num_stages > 1 else [0]
        counts = [base] * num_stages
        for s in order[:extra]:
            counts[s] += 1
        return counts
    # parameters of layers [j, k): prefix[k] - prefix[j] (a MoE layer holds all its experts)
    prefix = [0]
    for count in layer_param_counts(model):
        prefix.append(prefix[-1] + count)
    first = sum(embedding_params(model).values())
    tail = tail_params(model, pp_size=num_stages)
    last = sum(tail.values())
    # best[s][k]: smallest max-stage cost placing the first k layers on stages 0..s-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        extra_cost = (first if s == 1 else 0) + (last if s == num_stages else 0)
        for k in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, k):
                cost = max(best[s - 1][j], prefix[k] - prefix[j] + extra_cost)
                if cost < best[s][k]:
                    best[s][k], cut[s][k] = cost, j
    counts, k = [], n
    for s in range(num_stages, 0, -1):
        counts.append(k - cut[s][k])
        k = cut[s][k]
    return counts[::-1]


def rank_layer_ids(counts: list[int], pp_rank: int, pp_size: int) -> list[int]:
    """Global indices of the layers pipeline rank ``pp_rank`` holds, given the layers per stage ``counts``: its
    stages r, r + pp, ... (the loop placement of the interleaved schedule)."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [i for s in range(pp_rank, len(counts), pp_size) for i in range(starts[s], starts[s] + counts[s])]


def stage_counts(model: ModelConfig, parallel: ParallelConfig) -> list[int]:
    """Layers per stage (pp_size x pp_virtual_stages of them) for this layout, as the trainer splits them."""
    return layers_per_stage(model, parallel.pp_size * parallel.pp_virtual_stages, parallel.pp_balance,
                            parallel.pp_stage_layers)


def n_microbatches(parallel: ParallelConfig, dp_size: int) -> int:
    """Pipeline micro-batches per step: configured, or the gradient-accumulation steps."""
    return parallel.n_microbatches or parallel.grad_accum_steps(dp_size)


def check_schedule(pp_size: int, schedule_name: str, n_microbatches: int, batch_size: int,
                   virtual_stages: int = 1) -> None:
    """Raise ValueError unless ``batch_size`` sequences (per dp rank) run under this pipelining schedule."""
    if schedule_name not in PP_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule_name!r} is not one of {PP_SCHEDULES}")
    if n_microbatches < 1:
        raise ValueError(f"parallel.n_microbatches={n_microbatches} must be >= 1")
    if batch_size % n_microbatches:
        raise ValueError(
            f"the batch of {batch_size} sequences per dp rank does not split into n_microbatches={n_microbatches} "
            f"equal micro-batches; choose n_microbatches among the divisors of {batch_size}"
        )
    if virtual_stages > 1 and schedule_name not in MULTI_STAGE_SCHEDULES:
        raise ValueError(
            f"parallel.pp_virtual_stages={virtual_stages} needs a multi-stage schedule {MULTI_STAGE_SCHEDULES}, "
            f"not {schedule_name!r}"
        )
    # 1F1B keeps pp_size micro-batches in flight in its warm-up; the interleaved schedules
    # run rounds of pp_size micro-batches (torch: n_microbatches % rounds == 0; Megatron
    # requires n_microbatches % pp_size == 0 for interleaving).
    if schedule_name != "gpipe" and n_microbatches < pp_size:
        raise ValueError(
            f"parallel.pp_schedule={schedule_name!r} needs n_microbatches >= pp_size, "
            f"got n_microbatches={n_microbatches} < pp_size={pp_size}"
        )
    if schedule_name in MULTI_STAGE_SCHEDULES and n_microbatches % pp_size:
        raise ValueError(
            f"parallel.pp_schedule={schedule_name!r} needs n_microbatches to be a multiple of pp_size={pp_size}, "
            f"got {n_microbatches}"
        )


def check_pipeline(model: ModelConfig, parallel: ParallelConfig, dp_size: int, precision: str) -> None:
    """Everything a pipeline layout needs: a stage split, a schedule that runs the batch, a precision it takes."""
    stage_counts(model, parallel)
    if precision == "fp16":
        raise ValueError("train.precision=fp16 (loss scaling) is not supported with pipeline stages; use bf16")
    check_schedule(parallel.pp_size, parallel.pp_schedule, n_microbatches(parallel, dp_size),
                   parallel.global_batch_size // dp_size, parallel.pp_virtual_stages)


# ---------------------------------------------------------------- composition and devices


def check_offload(zero_stage: int, zero_offload: bool) -> None:
    """CPU offload is ZeRO-Offload (Ren et al. 2021, built on ZeRO-2): stages 2 and 3 (configs/ds/*_offload.json)."""
    if zero_offload and zero_stage not in (2, 3):
        raise ValueError(f"parallel.zero_offload=true needs parallel.zero_stage 2 or 3 (ZeRO-Offload), got "
                         f"{zero_stage}; configs/ds ships zero2_offload.json and zero3_offload.json")


# Why a ZeRO stage does not compose with pipeline stages (one reason per stage, for the error and docs/planner.md).
ZERO_WITH_PIPELINE_REFUSED = {
    2: ("ZeRO-2 reduce-scatters gradients in hooks during every micro-batch's backward, and its bookkeeping "
        "(the per-backward epilogue that flushes the reduce bucket and builds the gradient partitions) runs "
        "only inside DeepSpeed's own engine.backward; torch.distributed.pipelining runs the backward passes "
        "itself, so the partitions would need private DeepSpeed engine methods that DeepSpeed 0.19.8 itself "
        "refuses for pipelines (deepspeed/runtime/pipe/engine.py:77, 'ZeRO-2 and ZeRO-3 are incompatible with "
        "pipeline parallelism')"),
    3: ("ZeRO-3 gathers each module's parameter partitions in hooks armed by DeepSpeed's engine.forward and "
        "engine.backward, which the pipeline schedule bypasses (its stages run their own forward and backward); "
        "DeepSpeed 0.19.8 refuses it too (deepspeed/runtime/pipe/engine.py:77)"),
}


def check_composition(parallel: ParallelConfig) -> None:
    """Which regimes compose, and why not where they do not.

    ZeRO-1/2/3 compose with tensor parallelism (DeepSpeed partitions each rank's TP shard over the dp group only;
    ``parallel/zero/deepspeed.py`` marks the split parameters and sums partial TP gradients for it) and ZeRO-1
    with pipeline stages (the optimizer states of each stage sharded over its dp replicas; the schedule's
    gradients are reduced as DeepSpeed's own pipeline engine does). ZeRO-2 and ZeRO-3 with pipeline stages are
    refused (``ZERO_WITH_PIPELINE_REFUSED``); offload needs ZeRO-2/3.
    """
    check_offload(parallel.zero_stage, parallel.zero_offload)
    if parallel.zero_stage in ZERO_WITH_PIPELINE_REFUSED and parallel.pp_size > 1:
        raise ValueError(f"parallel.zero_stage={parallel.zero_stage} with parallel.pp_size={parallel.pp_size} is not "
                         f"supported: {ZERO_WITH_PIPELINE_REFUSED[parallel.zero_stage]}. With pipeline stages use "
                         "zero_stage 1 (optimizer states sharded over each stage's dp replicas), or ZeRO-2/3 with "
                         "tp and pp_size 1")


def check_ep(model: ModelConfig, ep_size: int, dp_size: int, zero_stage: int = 0, freeze: Sequence[str] = ()) -> None:
    """Expert parallelism (parallel/ep/) splits each MoE layer's experts over ep_size data-parallel ranks.

    It needs experts to split (model.n_experts > 0, ep dividing them) and ep dividing dp (its groups are drawn
    from the dp axis). Composes with TP (the MoE block is replicated on the TP ranks), pipeline stages and
    ZeRO-1/2 (DeepSpeed's MoE conventions, in ``engines/deepspeed_zero.DeepSpeedZero``: expert parameters in their
    own optimizer groups, partitioned over the expert-data-parallel group), and so with ZeRO-1/2 x TP (with or
    without SP: ZeRO partitions each TP rank's shard, the replicated MoE block's experts over edp) and ZeRO-1 x PP
    (what ``check_composition`` lets ZeRO do with stages); each is a parity test in tests/test_moe_parity.py.
    ZeRO-3 is refused at any tp and pp: DeepSpeed 0.19.8 accepts no MoE under stage 3 but its own AutoEP layers
    (engine._validate_zero3_moe_compatibility: "MoE not supported with Stage 3"), and without them it would
    partition each rank's different experts over the whole dp group as if they were one tensor.

    Fine-tuning (``train.freeze``, LoRA) composes with ep everywhere but one case: under ZeRO-1/2 a freeze that
    leaves some ep ranks with trainable experts and others with none. DeepSpeed then builds MoE optimizer groups
    on the first ranks only, and its gradient norm, reduced over the dp group one optimizer group after another
    (stage_1_and_2.py get_grad_norm_direct), would pair different groups of different ranks.
    """
    ep = ep_size
    if ep == 1:
        return
    if model.n_experts == 0:
        raise ValueError(f"parallel.ep_size={ep} needs a mixture-of-experts model (model.n_experts > 0); "
                         "a dense model has no experts to split: use ep_size 1")
    valid = [d for d in divisors(model.n_experts) if dp_size % d == 0]
    if model.n_experts % ep:
        raise ValueError(f"parallel.ep_size={ep} does not divide model.n_experts={model.n_experts}: every "
                         f"expert-parallel rank holds the same number of experts; valid ep_size here: {valid}")
    if dp_size % ep:
        raise ValueError(f"parallel.ep_size={ep} does not divide the data-parallel degree dp_size={dp_size}: "
                         f"expert-parallel groups are made of data-parallel ranks; valid ep_size here: {valid}")
    if zero_stage == 3:
        raise ValueError(f"parallel.zero_stage=3 with parallel.ep_size={ep} is not supported: DeepSpeed 0.19.8 "
                         "refuses MoE layers under ZeRO-3 other than its AutoEP ones (\"MoE not supported with Stage "
                         "3\"), and would otherwise partition each rank's different experts over the whole dp "
                         "group; use zero_stage 1 or 2 with ep, or ep_size 1 with ZeRO-3")
    if zero_stage in (1, 2) and (freeze or model.lora_rank):
        held = [trainable_expert_params(model, freeze, ep_size=ep, ep_rank=r) for r in range(ep)]
        if any(held) and not all(held):
            raise ValueError(
                f"train.freeze={list(freeze)} leaves ep ranks {[r for r, n in enumerate(held) if not n]} of "
                f"parallel.ep_size={ep} without a trainable expert while the others train theirs: under "
                f"parallel.zero_stage={zero_stage} DeepSpeed reduces the gradient norm over the data-parallel ranks "
                "one optimizer group at a time, and those ranks would have no expert group; freeze the experts "
                "alike on every ep rank (all, none, or the same projections of each), or use zero_stage 0")


def check_precision(precision: str, device_type: str) -> None:
    """fp16 trains with dynamic loss scaling, which this trainer runs on CUDA only."""
    if precision == "fp16" and device_type != "cuda":
        raise ValueError(f"train.precision=fp16 needs CUDA (dynamic loss scaling); the device is {device_type}: "
                         "use bf16 or fp32")


# ---------------------------------------------------------------- the whole check


def check_layout(cfg: Config, world_size: int, device_type: str) -> int:
    """Raise ValueError naming the values if ``cfg``'s layout cannot run on ``world_size`` ranks of
    ``device_type`` ("cpu" or "cuda"); return the data-parallel degree. No process group, no data, no torch."""
    cfg.validate()
    p = cfg.parallel
    dp = p.resolve(world_size)
    check_tp(cfg.model, p.tp_size)
    check_composition(p)
    check_ep(cfg.model, p.ep_size, dp, p.zero_stage, cfg.train.freeze)
    check_precision(cfg.train.precision, device_type)
    if p.pp_size > 1:
        check_pipeline(cfg.model, p, dp, cfg.train.precision)
    return dp


def fit_micro_batch(cfg: Config, world_size: int) -> tuple[Config, str | None]:
    """``cfg`` with a micro-batch that divides each DP rank's share of the global batch, and a note saying so.

    The global batch decides the training (the same samples per step in every layout); the micro-batch only how
    they are cut. A config written for 2 processes (global 16 = micro 8 x dp 2) run on 4 therefore keeps its
    global batch and takes the largest micro-batch <= the configured one that divides 16 / 4 = 4 (here 4), with
    a note, instead of refusing. A global batch that dp does not divide stays an error (``check_layout``).
    """
    p = cfg.parallel
    try:
        dp = p.dp_degree(world_size)
    except ValueError:
        return cfg, None  # check_layout reports it
    per_rank, rem = divmod(p.global_batch_size, dp)
    if rem or per_rank % p.micro_batch_size == 0:
        return cfg, None
    micro = max(d for d in range(1, min(p.micro_batch_size, per_rank) + 1) if per_rank % d == 0)
    note = (f"parallel.micro_batch_size={p.micro_batch_size} does not divide the {per_rank} sequences per "
            f"data-parallel rank (global_batch_size={p.global_batch_size} over dp_size={dp}); using "
            f"micro_batch_size={micro} (same global batch, so the same training; pass "
            f"--parallel.micro_batch_size to choose another divisor of {per_rank})")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, micro_batch_size=micro)), note


def check_nodes(world_size: int, gpus_per_node: int, tp_size: int) -> str | None:
    """Launchers start the same number of ranks on every node, so a world of several nodes fills whole ones
    (ValueError otherwise). A TP group spanning nodes runs, its all-reduces crossing the network in every layer:
    the note that says so (None when every TP group stays in a node, as the grid places them when tp divides
    the ranks per node)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")
    if world_size > gpus_per_node and world_size % gpus_per_node:
        raise ValueError(f"a world of {world_size} ranks does not fill whole nodes of {gpus_per_node}: every launcher "
                         f"starts the same number per node; use a multiple of {gpus_per_node}")
    per_node = min(world_size, gpus_per_node)
    if per_node % tp_size:
        return (f"note: parallel.tp_size={tp_size} does not divide the {per_node} ranks per node: TP groups span "
                "nodes and their all-reduces (every layer) cross the network")
    return None


def rank_grid(world_size: int, dp_size: int, pp_size: int, tp_size: int) -> list[list[list[int]]]:
    """``grid[d][p][t]`` = the global rank at those coordinates: ``arange(world).view(dp, pp, tp)``, tp fastest,
    so the ranks of a TP group are consecutive and stay inside a node."""
    if dp_size * pp_size * tp_size != world_size:
        raise ValueError(f"dp*pp*tp = {dp_size}*{pp_size}*{tp_size} does not equal the world size {world_size}")
    return [[[(d * pp_size + p) * tp_size + t for t in range(tp_size)] for p in range(pp_size)]
            for d in range(dp_size)]


def expert_groups(dp_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as lists of data-parallel indices.

    ep varies fastest inside dp (DeepSpeed's and Megatron-core's default order): an EP group is ep consecutive dp
    ranks, which hold different experts and exchange tokens; the EDP group of a rank is the dp ranks holding its
    experts (dp / ep of them), over which those experts' gradients are reduced."""
    if ep_size < 1 or dp_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide dp_size={dp_size}")
    ep = [[k * ep_size + j for j in range(ep_size)] for k in range(dp_size // ep_size)]
    edp = [[k * ep_size + j for k in range(dp_size // ep_size)] for j in range(ep_size)]
    return ep, edp
