"""`dist-trainer params | memory | plan`: thin entry points over the planner (parse, compute, print)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dist_trainer.config import CP_MODES, OPTIM_STATE_DTYPES, ZERO_STAGES, ModelConfig
from dist_trainer.config_load import model_config
from dist_trainer.config_model import BASE_WEIGHT_DTYPES
from dist_trainer.facts.finetune import frozen_modules
from dist_trainer.facts.quant_sizes import check_int8_base, int8_weights
from dist_trainer.files import output_dir, refuse_nonempty
from dist_trainer.planner.activation_spec import PRECISIONS, RECOMPUTE
from dist_trainer.planner.axes.cp import MIN_CP_TOKENS
from dist_trainer.planner.emit import write_plan
from dist_trainer.planner.finetune import module_rows
from dist_trainer.planner.hardware import get_hardware, hardware_profiles
from dist_trainer.planner.memory import (
    GiB,
    Layout,
    Overheads,
    RankMemory,
    TrainingOptions,
    node_host_bytes,
    predict_all_stages,
    with_loss_chunk,
)
from dist_trainer.planner.options import OPTIMIZERS
from dist_trainer.planner.params import param_breakdown
from dist_trainer.planner.scale import max_model
from dist_trainer.planner.search import PlannedLayout, plan_layouts


def register(subparsers: argparse._SubParsersAction,
             check_written: Callable[[Path, int, int, str], None] | None = None) -> None:
    """Add the params, memory and plan subcommands to the dist-trainer parser. ``check_written(run_yaml,
    world_size, gpus_per_node, device)`` is called on what ``plan --out`` writes: the trainer's pre-launch check,
    handed in from above (the planner never imports the trainer)."""
    p = subparsers.add_parser("params", help="exact parameter count, per module (total, active per token, trainable)")
    _model_args(p)
    p.set_defaults(func=run_params)

    m = subparsers.add_parser("memory", help="predicted per-rank memory of one layout")
    _model_args(m)
    _option_args(m)
    m.add_argument("--tp", type=int, default=1)
    m.add_argument("--pp", type=int, default=1)
    m.add_argument("--dp", type=int, default=1)
    m.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models; divides dp)")
    m.add_argument("--cp", type=int, default=1, help="context-parallel degree: each sequence split over cp ranks")
    m.add_argument("--cp-mode", default="ring", choices=CP_MODES, help="ring attention or all_to_all (Ulysses)")
    m.add_argument("--zero", "--zero-stage", dest="zero", type=int, default=0, choices=ZERO_STAGES,
                   help="ZeRO stage (parallel.zero_stage)")
    m.add_argument("--offload", action="store_true", help="ZeRO CPU offload of optimizer (stage 3: and params)")
    m.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True,
                   help="train.async_save (the trainer's default): a save's parameters and optimizer state staged "
                        "in host memory (not under ZeRO, whose files DeepSpeed writes)")
    m.add_argument("--micro-batch", type=int, default=1)
    m.add_argument("--microbatches", type=int, default=1, help="micro-batches per DP rank per step")
    m.add_argument("--seq-len", type=int, default=None, help="default: model.max_seq_len")
    m.add_argument("--checkpointing", default="none", choices=RECOMPUTE)
    m.add_argument("--checkpoint-every", type=int, default=1)
    m.add_argument("--activation-offload", type=float, default=0.0, metavar="SHARE",
                   help="parallel.activation_offload: the share of each rank's layers whose saved activations go to "
                        "host memory")
    m.add_argument("--sp", action="store_true", help="sequence parallelism (tp > 1)")
    m.add_argument("--pp-schedule", default="1f1b")
    m.add_argument("--virtual-stages", type=int, default=1)
    _host_args(m)
    m.set_defaults(func=run_memory)

    q = subparsers.add_parser("plan", help="search layouts for N GPUs, rank by estimated step time")
    _model_args(q)
    _option_args(q)
    q.add_argument("--gpus", type=int, required=True)
    q.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8: a DGX/HGX node)")
    q.add_argument("--gpu-memory-gb", type=float, default=None, help="GiB per GPU; default: the hardware's")
    q.add_argument("--seq-len", type=int, required=True)
    q.add_argument("--global-batch", type=int, required=True)
    q.add_argument("--hardware", default="A100-80GB", help=f"one of {', '.join(hardware_profiles())}")
    q.add_argument("--top", type=int, default=5)
    q.add_argument("--out", default=None, help="write run.yaml, ds_config.json (ZeRO) and launch.sh here")
    q.add_argument("--force", action="store_true", help="write into --out although it is not empty")
    q.add_argument("--max-model", action="store_true", help="largest scaled family model per ZeRO stage")
    q.add_argument("--verify", type=int, default=0, metavar="K",
                   help="trial-run the top K layouts here through the launch scripts --out writes, re-rank them by "
                        "measured step time and print predicted against measured")
    q.add_argument("--verify-steps", type=int, default=6, help="steps per trial run (the first is not timed)")
    q.add_argument("--verify-data", default="data/default", help="prepared data the trial runs read")
    _host_args(q, hardware=False)
    # Search limits: the best layout within what the cluster or the code allows (plan_layouts' keyword arguments)
    tp = q.add_mutually_exclusive_group()
    tp.add_argument("--tp", type=int, default=None, help="only this tensor-parallel degree")
    tp.add_argument("--max-tp", type=int, default=None, help="tensor-parallel degrees up to this")
    pp = q.add_mutually_exclusive_group()
    pp.add_argument("--pp", type=int, default=None, help="only this many pipeline stages")
    pp.add_argument("--no-pp", action="store_true", help="no pipeline (--pp 1)")
    q.add_argument("--zero", default=",".join(map(str, ZERO_STAGES)),
                   help="allowed ZeRO stages, comma-separated (0 = DDP)")
    q.add_argument("--no-offload", action="store_true", help="no ZeRO CPU offload")
    q.add_argument("--max-cp", type=int, default=None,
                   help="context-parallel degrees up to this (default: those leaving each rank >= "
                        f"{MIN_CP_TOKENS} tokens of a sequence; 1 = none)")
    q.set_defaults(func=run_plan, check_written=check_written)


def _host_args(p: argparse.ArgumentParser, hardware: bool = True) -> None:
    if hardware:  # plan has its own --hardware
        p.add_argument("--hardware", default="A100-80GB", help="profile whose host memory is the default budget")
        p.add_argument("--gpus-per-node", type=int, default=8, help="ranks sharing one node's host memory")
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory per node in GiB for offloaded states; default: the hardware's host memory "
                        "per GPU x gpus-per-node (DGX nodes: A100-80GB/H100/H200 2 TB for 8 GPUs, V100 DGX-2 "
                        "1.5 TB for 16)")


def _host_budget(args: argparse.Namespace) -> int:
    if args.host_memory_gb is not None:
        if args.host_memory_gb <= 0:
            raise ValueError(f"--host-memory-gb={args.host_memory_gb} must be > 0")
        return round(args.host_memory_gb * GiB)
    return get_hardware(args.hardware).host_memory_per_node(args.gpus_per_node)


def _search_limits(args: argparse.Namespace) -> dict[str, Any]:
    """plan_layouts' keyword arguments for --tp/--max-tp/--pp/--no-pp/--zero/--no-offload."""
    try:
        stages = tuple(sorted({int(z) for z in args.zero.split(",") if z.strip()}))
    except ValueError:
        raise ValueError(f"--zero={args.zero!r} must be comma-separated ZeRO stages among 0,1,2,3") from None
    if not stages or any(z not in ZERO_STAGES for z in stages):
        raise ValueError(f"--zero={args.zero!r} must be comma-separated ZeRO stages among 0,1,2,3")
    if args.max_cp is not None and args.max_cp < 1:
        raise ValueError(f"--max-cp={args.max_cp} must be >= 1 (1: no context parallelism)")
    return {"tp_size": args.tp, "max_tp_size": args.max_tp, "pp_size": 1 if args.no_pp else args.pp,
            "zero_stages": stages, "allow_offload": not args.no_offload, "max_cp_size": args.max_cp}


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name (configs/models) or YAML file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    # fine-tuning (dist_trainer/facts/finetune.py): what trains changes the gradients, optimizer states and activations
    p.add_argument("--lora-rank", type=int, default=0, help="model.lora_rank: LoRA adapters of this rank, base frozen")
    p.add_argument("--lora-targets", default="q_proj,v_proj", help="model.lora_targets: linears, or all_linear")
    p.add_argument("--freeze", default="", help="train.freeze: comma-separated module patterns or presets "
                                                "(embeddings, bottom:N, norms_only)")
    p.add_argument("--base-weight-dtype", default="fp32", choices=BASE_WEIGHT_DTYPES,
                   help="model.base_weight_dtype: int8 stores the frozen layer linears as int8 + fp32 group scales")
    p.add_argument("--base-weight-group", type=int, default=64,
                   help="model.base_weight_group: input columns per int8 scale")
    p.add_argument("--loss-chunk-tokens", type=int, default=None, metavar="N",
                   help="model.loss_chunk_tokens: the head and the loss N tokens at a time (0: the whole micro-batch; "
                        "default: the model's, or where it leaves it at 0 the planner's choice per layout: chunks of "
                        "at most 1 GiB of fp32 logits where that lowers the loss's bytes)")


def _option_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--compile", action="store_true",
                   help="train.compile: the elementwise work priced in inductor's fused kernels (default: eager "
                        "PyTorch, each op its own kernel); plan --out writes train.compile: true")
    p.add_argument("--grad-dtype", default=None, choices=("fp32", "bf16", "fp16"))
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="optim.name's entry (optim_entries.py): its state bytes; muon adds its Newton-Schulz and tp "
                        "gather/scatter (under ZeRO, dp alone: dp reduce/broadcast) to the step time")
    p.add_argument("--fp32-grad-copy", default="auto", choices=("auto", "on", "off"),
                   help="fp32 gradients beside 16-bit ones. auto: what the optimizer does (DeepSpeed ZeRO builds "
                        "them in step(), charged as step buffers; torch AdamW none); on: a persistent copy in the "
                        "optimizer states (Megatron's distributed optimizer); off: none")
    p.add_argument("--optim-state-dtype", default="fp32", choices=OPTIM_STATE_DTYPES,
                   help="optim.state_dtype: Adam's moments in fp32 (8 bytes per parameter), bf16 (4) or int8 (2 + "
                        "block scales)")
    p.add_argument("--attention-kernel", default="flash", choices=("flash", "math"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--target-len", type=int, default=None, metavar="N",
                   help="an encoder-decoder's decoder length (default: span corruption's targets for --seq-len "
                        "sources, or --seq-len with --pairs)")
    p.add_argument("--pairs", action="store_true",
                   help="an encoder-decoder trained on seq2seq pairs (padded sources, data.objective=seq2seq) "
                        "rather than span corruption")
    p.add_argument("--cuda-context-gb", type=float, default=0.5)
    p.add_argument("--fragmentation", type=float, default=0.05)


def _load_model(args: argparse.Namespace) -> ModelConfig:
    """The preset with --lora-rank/--lora-targets; --freeze checked against it (ValueError naming a bad pattern)."""
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank={args.lora_rank} must be >= 0 (0 = no adapters)")
    chunk = {} if args.loss_chunk_tokens is None else {"loss_chunk_tokens": args.loss_chunk_tokens}
    cfg = model_config(args.model, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                       base_weight_dtype=args.base_weight_dtype, base_weight_group=args.base_weight_group, **chunk)
    frozen_modules(cfg, _freeze(args))
    check_int8_base(cfg, _freeze(args))
    return cfg


def _choose_loss_chunk(args: argparse.Namespace, cfg: ModelConfig) -> bool:
    """Whether the planner chooses model.loss_chunk_tokens: neither --loss-chunk-tokens nor the model sets it."""
    return args.loss_chunk_tokens is None and not cfg.loss_chunk_tokens


def _loss_line(chunk: int, chosen: bool) -> str:
    if not chunk:
        return "loss: the whole logits (model.loss_chunk_tokens=0)"
    return (f"loss: chunks of {chunk:,} tokens (model.loss_chunk_tokens={chunk}"
            + (", the planner's choice; --loss-chunk-tokens 0 for the whole logits)" if chosen else ")"))


def _freeze(args: argparse.Namespace) -> list[str]:
    return [p.strip() for p in args.freeze.split(",") if p.strip()]


def _options(args: argparse.Namespace) -> tuple[TrainingOptions, Overheads]:
    opts = TrainingOptions(precision=args.precision, grad_dtype=args.grad_dtype, optimizer=args.optimizer,
                           attention_kernel=args.attention_kernel, device=args.device,
                           fp32_grad_copy={"auto": None, "on": True, "off": False}[args.fp32_grad_copy],
                           freeze=tuple(_freeze(args)), optim_state_dtype=args.optim_state_dtype,
                           target_len=args.target_len, source_mask=args.pairs,
                           async_save=getattr(args, "async_save", False), fused_elementwise=args.compile)
    over = Overheads(cuda_context=round(args.cuda_context_gb * GiB), fragmentation=args.fragmentation)
    return opts, over


def run_params(args: argparse.Namespace) -> int:
    cfg = _load_model(args)
    bd = param_breakdown(cfg)
    trains = module_rows(cfg, _freeze(args))
    rows = [{"module": name, "per_instance": each, "instances": n, "total": tot, "share": tot / bd.total,
             "active": active, "trainable": trains.get(name, 0)} for name, each, n, tot, active in bd.rows(active=True)]
    trainable = sum(trains.values())
    # what fine-tuning saves against training every weight of the base model (Hu et al. 2021, section 4.2)
    reduction = 1 - trainable / bd.base_total
    weights = weight_bytes(cfg, _freeze(args), bd.total)
    if args.json:
        print(json.dumps({"model": args.model, "total": bd.total, "active": bd.active, "base_total": bd.base_total,
                          "trainable": trainable, "reduction": reduction, "weight_bytes": weights,
                          "per_layer": bd.layer_total,
                          "n_layers": bd.n_layers, "n_moe_layers": bd.n_moe_layers,
                          "per_decoder_layer": bd.decoder_layer_total, "n_decoder_layers": bd.n_decoder_layers,
                          "stacks": {k.strip(): v for k, v in bd.stacks().items()}, "breakdown": rows}, indent=2))
        return 0
    width = max(28, *(len(r["module"]) + 2 for r in rows))
    print(f"{'module':<{width}}{'each':>16}{'x':>6}{'total':>18}{'share':>9}{'active/token':>18}{'trainable':>18}")
    for r in rows:
        print(f"{r['module']:<{width}}{r['per_instance']:>16,}{r['instances']:>6}{r['total']:>18,}{r['share']:>9.2%}"
              f"{r['active']:>18,}{r['trainable']:>18,}")
    if bd.n_layers:
        one = "one dense layer" if bd.n_moe_layers else "one encoder layer" if bd.n_decoder_layers else "one layer"
        print(f"{one:<{width}}{bd.layer_total:>16,}")
    if bd.n_decoder_layers:
        print(f"{'one decoder layer':<{width}}{bd.decoder_layer_total:>16,}")
        for part, n in bd.stacks().items():
            print(f"{part:<{width}}{'':>22}{n:>18,}{n / bd.total:>9.2%}")
    print(f"{'total':<{width}}{'':>22}{bd.total:>18,}{'':>9}{bd.active:>18,}{trainable:>18,}")
    if trainable != bd.total:
        print(f"trainable {trainable:,} of {bd.total:,} ({trainable / bd.total:.4%}); base model {bd.base_total:,}: "
              f"{reduction:.4%} fewer trainable parameters than training it all")
    if weights["int8_weights"]:
        print(f"weights: {weights['bytes']:,} bytes in fp32 with {weights['int8_weights']:,} int8 base weights and "
              f"{weights['int8_scales']:,} fp32 scales ({weights['bytes'] / (4 * bd.total):.4f} of "
              f"{4 * bd.total:,} all-fp32 bytes; {weights['per_int8_weight']:.4f} bytes per int8 weight)")
    return 0


def weight_bytes(cfg: ModelConfig, freeze: list[str], total: int) -> dict[str, Any]:
    """The whole model's weight bytes in fp32 with ``model.base_weight_dtype``'s int8 weights and their scales."""
    w, scales = int8_weights(cfg, freeze)
    return {"bytes": 4 * (total - w) + w + 4 * scales, "int8_weights": w, "int8_scales": scales,
            "per_int8_weight": (w + 4 * scales) / w if w else 0.0}


def run_memory(args: argparse.Namespace) -> int:
    cfg = _load_model(args)
    opts, over = _options(args)
    layout = Layout(tp_size=args.tp, pp_size=args.pp, dp_size=args.dp, ep_size=args.ep, cp_size=args.cp,
                    cp_mode=args.cp_mode, zero_stage=args.zero,
                    zero_offload=args.offload, micro_batch_size=args.micro_batch, n_microbatches=args.microbatches,
                    activation_checkpointing=args.checkpointing, checkpoint_every=args.checkpoint_every,
                    activation_offload=args.activation_offload,
                    sequence_parallel=args.sp, pp_schedule=args.pp_schedule, pp_virtual_stages=args.virtual_stages)
    if args.seq_len is not None and args.seq_len < 1:  # 0 planned for max_seq_len (`args.seq_len or ...`)
        raise ValueError(f"--seq-len={args.seq_len} must be >= 1 (leave it out for model.max_seq_len="
                         f"{cfg.max_seq_len})")
    seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    chosen = _choose_loss_chunk(args, cfg)
    if chosen:
        cfg = with_loss_chunk(cfg, layout, seq_len=seq_len, options=opts)
    stages = predict_all_stages(cfg, layout, seq_len=seq_len, options=opts, overheads=over)
    budget = _host_budget(args)
    node = node_host_bytes(max(m.host for m in stages), world_size=layout.world_size,
                           gpus_per_node=args.gpus_per_node)
    if args.json:
        print(json.dumps({"layout": layout.__dict__, "loss_chunk_tokens": cfg.loss_chunk_tokens,
                          "stages": [s.to_dict() for s in stages],
                          "host_per_node": node, "host_memory_bytes": budget, "host_fits": node <= budget}, indent=2))
        return 0
    print(layout.describe())
    print(_loss_line(cfg.loss_chunk_tokens, chosen))
    for s in stages:
        print(f"stage {s.pp_rank}: " + _memory_line(s))
        for k, v in s.detail.items():
            print(f"    {k:<40}{v / GiB:>10.3f} GiB")
    if node:
        print(f"host: {node / GiB:,.1f} GiB per node ({min(args.gpus_per_node, layout.world_size)} ranks) of "
              f"{budget / GiB:,.0f} GiB: {'fits' if node <= budget else 'does not fit'}")
    return 0


def _memory_line(m: RankMemory) -> str:
    return (f"params {m.params / GiB:.2f}  grads {m.grads / GiB:.2f}  optimizer {m.optimizer / GiB:.2f}  "
            f"activations {m.activations / GiB:.2f}  step buffers {m.step_buffers / GiB:.2f}  "
            f"overheads {m.overheads / GiB:.2f}  "
            f"= {m.device_total / GiB:.2f} GiB on device, host {m.host / GiB:.2f} GiB")


def run_plan(args: argparse.Namespace) -> int:
    if args.out:  # before the search: nothing of the user's is replaced, and no work is wasted on a refusal
        output_dir(args.out, "--out")
        refuse_nonempty(args.out, args.force)
    cfg = _load_model(args)
    opts, over = _options(args)
    hw = get_hardware(args.hardware)
    memory = round(args.gpu_memory_gb * GiB) if args.gpu_memory_gb else hw.memory_bytes
    shape = dict(n_gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory_bytes=memory, seq_len=args.seq_len,
                 global_batch=args.global_batch, hardware=hw, options=opts, overheads=over,
                 host_memory_bytes=_host_budget(args), **_search_limits(args))
    if args.max_model:
        start = time.perf_counter()
        shape.pop("allow_offload")  # max_model plans without offload
        rows = max_model(cfg, **shape)
        found = [{"zero_stage": r.zero_stage, "n_params": r.n_params,
                  "model": None if r.model is None else {k: getattr(r.model, k) for k in
                                                         ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")},
                  "layout": None if r.planned is None else r.planned.layout.__dict__} for r in rows]
        if args.json:
            print(json.dumps({"max_model": found, "seconds": time.perf_counter() - start}, indent=2))
        else:
            for r in rows:
                what = ("nothing fits" if r.planned is None
                        else f"{r.n_params / 1e9:.1f}B  ({r.planned.layout.describe()})")
                print(f"ZeRO-{r.zero_stage}: {what}")
            print(f"searched in {time.perf_counter() - start:.2f} s")
        return 0
    chosen = _choose_loss_chunk(args, cfg)
    res = plan_layouts(cfg, **shape, choose_loss_chunk=chosen)
    top = res.layouts[: args.top]
    if args.json:
        print(json.dumps({"seconds": res.seconds, "n_considered": res.n_considered, "n_fit": len(res.layouts),
                          "layouts": [p.to_dict() for p in top], "over_by": res.over_by, "notes": res.notes,
                          "closest": None if res.closest is None else res.closest.to_dict()}, indent=2))
    else:
        print(f"{res.n_considered} layouts considered, {len(res.layouts)} fit in {memory / GiB:.1f} GiB per GPU "
              f"and {res.host_memory_bytes / GiB:,.0f} GiB of host memory per node ({res.seconds:.2f} s)")
        print("elementwise work priced " + ("fused (train.compile)" if args.compile else
                                            "eager, each op its own kernel (--compile: train.compile's fused kernels)"))
        for i, p in enumerate(top, 1):
            host = f"; host {p.host_per_node / GiB:,.1f} GiB per node" if p.host_per_node else ""
            print(f"{i}. {p.layout.describe()}\n   step {p.time.total:.3f} s  MFU {p.time.mfu:.1%}  "
                  f"compute {p.time.compute:.3f} s  bubble {p.time.bubble:.3f} s\n   "
                  + _memory_line(p.memory) + host)
            print("   " + _loss_line(p.loss_chunk_tokens, chosen))
            for axis, a in p.time.axes.items():
                print(f"   {axis:<8}{a.bytes / 1e9:>10.3f} GB  {a.time:.3f} s, exposed {a.exposed:.3f} s: {a.rule}")
        for note in res.notes:
            print(note)
    # with --json, stdout holds the one JSON document: what follows is for people, on stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.verify and top:  # trial runs on the machines at hand; the measured fastest becomes the plan
            top = _verify(args, cfg, res.layouts[:args.verify], opts)
        if args.out and top:
            written = write_plan(Path(args.out), cfg, top[0], seq_len=args.seq_len, opts=opts,
                                 gpus_per_node=args.gpus_per_node)
            print(f"wrote {', '.join(str(p) for p in written)}")
            if args.check_written is not None:  # the trainer's own pre-launch check on what was written
                args.check_written(Path(args.out) / "run.yaml", top[0].layout.world_size, args.gpus_per_node,
                                   opts.device)
    return 0 if top else 1


def _verify(args: argparse.Namespace, cfg: ModelConfig, candidates: list[PlannedLayout],
            opts: TrainingOptions) -> list[PlannedLayout]:
    import tempfile

    from dist_trainer.planner.verify import report, run_trials

    def write(folder: Path, planned: PlannedLayout) -> None:
        write_plan(folder, cfg, planned, seq_len=args.seq_len, opts=opts, gpus_per_node=args.gpus_per_node)

    with tempfile.TemporaryDirectory(prefix="plan_verify_") as tmp:
        trials = run_trials(candidates, write, Path(tmp), steps=args.verify_steps, data=args.verify_data)
    print(f"\nverified the top {len(trials)} on this machine ({args.verify_steps} steps each), fastest measured "
          f"first:\n{report(trials)}")
    return [t.planned for t in trials if t.ok]
