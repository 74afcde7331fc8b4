"""``dist-trainer`` entry point: parse, build, run, close. The logic lives in the modules.

    dist-trainer prepare  --input PATH... --out DIR --vocab-size N | --tokenizer HF_DIR
    dist-trainer train    [--config FILE] [--section.field=value ...]   (under torchrun/deepspeed/...)
    dist-trainer check    --config FILE --world-size N [--gpus-per-node G]  (the pre-launch check, no launch)
    dist-trainer generate --checkpoint RUN_OR_STEP --prompt TEXT | --prompt-ids 1,2,3 [--greedy] [--json]
                          (an encoder-decoder: --source TEXT | --source-ids 1,2,3)
    dist-trainer export   --checkpoint RUN_OR_STEP --out DIR [--merge-lora] [--quantize int8]  (safetensors)
    dist-trainer eval     --checkpoint A [--checkpoint B ...] [--data DIR]   (validation loss, side by side)
    dist-trainer report   RUN [--out DIR]                                  (PNGs from metrics.jsonl)
    dist-trainer attention --checkpoint RUN_OR_STEP --text TEXT --out DIR  (attention maps, per-head table)
    dist-trainer params | memory | plan ...                             (the planner)
    dist-trainer memory-experiment --model PRESET --stages 0,1,2,3 --nprocs N   (ZeRO, measured vs predicted)

A user error (a bad value, a path that cannot be used, a full disk) prints one line
``dist-trainer COMMAND: error: ...`` and exits with 2; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path


def _register_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (run under torchrun/deepspeed/accelerate/srun for >1 rank)",
                       description="Train. Any --section.field=value after the options overrides the config "
                                   "file (precedence: CLI > file > defaults), e.g. --model.n_layers=4.")
    p.add_argument("--config", help="run config YAML (configs/runs/*.yaml); defaults apply where absent")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    import torch

    from dist_trainer.config_load import load_config
    from dist_trainer.train.distributed import detect_launch_env, shutdown_distributed
    from dist_trainer.train.preempt import EXIT_ABORTED, EXIT_PREEMPTED, Aborted, Preempted, PreemptionGuard
    from dist_trainer.train.preempt import StoppedDuringStartup as StoppedEarly
    from dist_trainer.train.summary import print_summary
    from dist_trainer.train.trainer import Trainer

    code, rank0, out_dir = 0, detect_launch_env().rank == 0, None
    trainer: Trainer | None = None
    # until the trainer is built a signal stops this rank at once, with nothing to save (train/preempt.py); after,
    # it is recorded and handed to the trainer's own guard
    with PreemptionGuard(1, torch.device("cpu"), start_up=True) as start_up:
        try:
            cfg = load_config(args.config, args.overrides)
            out_dir = cfg.train.out_dir
            trainer = Trainer(cfg)  # its out_dir lock is released if it stops during its construction
            start_up.start_up = False
            result = trainer.train()
            if rank0:
                print_summary(cfg, result)
        except StoppedEarly as stop:
            if rank0:
                sys.stderr.write(f"dist-trainer train: {stop}: nothing saved{_kept(out_dir)}; run it again (exit "
                                 f"status {EXIT_PREEMPTED})\n")
            code = EXIT_PREEMPTED
        except Preempted as stop:  # SIGTERM/SIGUSR1/SIGINT/SIGHUP: every rank saved the same step (train/preempt.py)
            if rank0:
                sys.stderr.write(f"dist-trainer train: {stop}\n")
            code = EXIT_PREEMPTED
        except Aborted as stop:  # a second Ctrl-C
            if rank0:
                sys.stderr.write(f"dist-trainer train: {stop} (exit status {EXIT_ABORTED})\n")
            code = EXIT_ABORTED
        finally:
            if trainer is not None:
                trainer.close()  # out_dir released (train() does it; a signal may come before train())
            shutdown_distributed()
    if trainer is not None and trainer.has_process_group:
        # Skip interpreter teardown: gloo/DeepSpeed threads sometimes abort at exit
        # ("terminate called without an active exception") after the work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _kept(out_dir: str | None) -> str:
    """What a run stopped during start-up kept: its newest checkpoint (once its config is read)."""
    if out_dir is None:
        return ""
    from dist_trainer.checkpoint.publish import latest_checkpoint

    latest = latest_checkpoint(Path(out_dir) / "checkpoints")
    return f" (the newest checkpoint in {out_dir} is {latest}: --train.resume=true continues from it)" if latest \
        else f" ({out_dir} holds no checkpoint)"


def _register_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="the trainer's complete pre-launch check of a run config for N ranks, here",
                       description="Validate a run config for a world this machine is not (no process group, no "
                                   "data read beyond its meta.json): what `train` checks before it starts. "
                                   "--section.field=value overrides as for train.")
    p.add_argument("--config", required=True, help="run config YAML (e.g. the run.yaml `plan --out` wrote)")
    p.add_argument("--world-size", type=int, required=True, help="ranks the job will run (GPUs)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: one node)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the device the job runs on")
    p.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    from dist_trainer.config_load import load_config
    from dist_trainer.train.check import check_run

    cfg = load_config(args.config, args.overrides)
    print("\n".join(check_run(cfg, args.world_size, args.gpus_per_node, args.device)))
    return 0


def _check_written(run_yaml: Path, world_size: int, gpus_per_node: int, device: str) -> None:
    """`plan --out`: the trainer's pre-launch check on the run.yaml it wrote (a refused layout is an error; data
    that does not fit the planned model yet is reported as the step left to do)."""
    from dist_trainer.config_load import load_config
    from dist_trainer.train.check import check_run

    report = check_run(load_config(run_yaml), world_size, gpus_per_node, device, data_required=False)
    print(f"dist-trainer check --config {run_yaml} --world-size {world_size} --gpus-per-node {gpus_per_node}:")
    print("\n".join(f"  {line}" for line in report))


def _register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint, or greedy ids and log-probs to compare",
                       description="Generate from a checkpoint, streaming each token as it is made. With --json: "
                                   "one JSON document on stdout {\"prompt_ids\", \"ids\" (the new ids), "
                                   "\"logprobs\" (of each new id under the model's full softmax, fp32)}, "
                                   "notes on stderr.")
    p.add_argument("--checkpoint", required=True,
                   help="run folder, its checkpoints/ folder, a step folder, or an exported model folder")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", metavar="IDS",
                        help="token ids instead of text, e.g. 1,2,3 (no tokenizer needed; write --prompt-ids=-1 "
                             "for an id argparse would take for an option)")
    prompt.add_argument("--source", help="an encoder-decoder's input text (encoded once; the decoder answers it)")
    prompt.add_argument("--source-ids", metavar="IDS", help="an encoder-decoder's input as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=100,
                   help="at most this many new tokens (capped where they would overflow the model's context "
                        "unless --sliding-window)")
    p.add_argument("--greedy", action="store_true", help="the most likely token at every step (--temperature 0)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sliding-window", action="store_true",
                   help="go on past the model's context, each token seeing the last max_seq_len tokens")
    p.add_argument("--ignore-eos", action="store_true", help="generate all --max-new-tokens, past any EOS")
    p.add_argument("--ignore-generation-config", action="store_true",
                   help="leave out the checkpoint folder's generation_config.json decoding fields (repetition_penalty, "
                        "no_repeat_ngram_size, suppress_tokens, ...), which are otherwise applied as transformers "
                        "applies them (a field not applied is refused by name)")
    p.add_argument("--json", action="store_true", help="print one JSON document (ids and log-probs) at the end")
    p.add_argument("--data", default=None,
                   help="folder with tokenizer.json (default: the checkpoint folder's own, else the run's data.path "
                        "or its first data.sources folder)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    import json

    from dist_trainer.train.generate import generate, parse_prompt_ids

    if args.greedy and args.temperature not in (None, 0):
        raise ValueError(f"--greedy and --temperature {args.temperature} disagree: greedy is temperature 0")
    temperature = 0.0 if args.greedy else (0.8 if args.temperature is None else args.temperature)
    prompt_ids = None if args.prompt_ids is None else parse_prompt_ids(args.prompt_ids)
    source_ids = None if args.source_ids is None else parse_prompt_ids(args.source_ids)

    def note(text: str) -> None:
        sys.stderr.write(f"generate: {text}\n")
        sys.stderr.flush()

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(args.checkpoint, prompt=args.prompt, prompt_ids=prompt_ids, source=args.source,
                      source_ids=source_ids, max_new_tokens=args.max_new_tokens,
                      temperature=temperature, top_k=args.top_k, seed=args.seed, data_path=args.data,
                      sliding_window=args.sliding_window, ignore_eos=args.ignore_eos,
                      ignore_generation_config=args.ignore_generation_config,
                      on_text=None if args.json else write, on_note=note)
    note(result.notes[-1])
    if args.json:
        write(json.dumps(result.as_json()) + "\n")
    return 0


def _register_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as one plain model (a Hugging Face folder by default)")
    p.add_argument("--checkpoint", required=True,
                   help="run folder, its checkpoints/ folder, a step folder, an export or a Hugging Face folder")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--format", default="hf", choices=("hf", "native"),
                   help="hf: safetensors shards + config.json that transformers reads (default); native: this "
                        "project's model.safetensors + config.json")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="tensor dtype (hf)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (hf), e.g. 5GB, 500MB")
    p.add_argument("--adapter", action="store_true",
                   help="hf: a LoRA run's adapters alone as a PEFT folder (adapter_config.json + "
                        "adapter_model.safetensors); without it they are folded into the weights")
    p.add_argument("--merge-lora", action="store_true",
                   help="native: fold a LoRA run's adapters into their weights (W0 + alpha/r B A)")
    p.add_argument("--quantize", default=None, choices=("int8",),
                   help="int8: the layer linears' weights as int8 with one fp32 scale per output channel "
                        "(weight-only; a LoRA run needs --merge-lora with --format native)")
    p.add_argument("--force", action="store_true", help="write into a folder that already holds files")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from dist_trainer.train.export import export_checkpoint

    for path in export_checkpoint(args.checkpoint, args.out, args.format, args.dtype, args.max_shard_size,
                                  merge_lora=args.merge_lora, adapter=args.adapter, force=args.force,
                                  quantize=args.quantize):
        print(path)
    return 0


def _register_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="validation loss of checkpoints / exports, side by side (the first is the "
                                    "reference)")
    p.add_argument("--checkpoint", action="append", required=True,
                   help="run folder, checkpoints/ or step folder, an export or a Hugging Face folder; repeat to "
                        "compare (an int8 export beside the fp32 model it came from)")
    p.add_argument("--data", default=None, help="prepared data folder (default: the first run checkpoint's)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the first run checkpoint's data.seq_len")
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--eval-batches", type=int, default=None, help="global batches evaluated (train.eval_batches)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from dist_trainer.train.evaluate import evaluate

    overrides = {"data": args.data, "seq_len": args.seq_len, "global_batch_size": args.global_batch_size,
                 "micro_batch_size": args.micro_batch_size, "eval_batches": args.eval_batches, "seed": args.seed}
    print(evaluate(args.checkpoint, overrides, as_json=args.json))
    return 0


def _register_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="draw a run's metrics (loss, LR, grad norm, throughput, health) as PNGs; "
                                      "with train.profile_steps, print the step's time split beside the planner's")
    p.add_argument("run", help="the run folder (train.out_dir) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: RUN/report)")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from dist_trainer.health.report import write_report
    from dist_trainer.train.profile_split import profile_report

    for path in write_report(args.run, args.out):
        print(path)
    split = profile_report(Path(args.run))  # train.profile_steps: the step's split beside the planner's
    if split is not None:
        print(split)
    return 0


def _register_attention(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attention", help="attention maps per layer and per-head diagnostics of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="run folder, its checkpoints/ folder, or a step folder")
    p.add_argument("--text", required=True, help="the text whose attention is drawn")
    p.add_argument("--out", required=True, help="folder for attention_layerNN.png and attention.json")
    p.add_argument("--data", default=None,
                   help="folder with tokenizer.json (default: the run's data.path or its first data.sources folder)")
    p.set_defaults(func=run_attention)


def run_attention(args: argparse.Namespace) -> int:
    from dist_trainer.health.attention import diagnose

    print(diagnose(args.checkpoint, args.text, args.out, args.data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser. The modules imported here import torch only inside the functions that run,
    so `--help` and the planner's subcommands start in a fraction of a second (tests/test_cli_startup.py)."""
    from dist_trainer.data import prepare
    from dist_trainer.experiments import calibrate, memory_experiment
    from dist_trainer.planner import cli as planner_cli

    parser = argparse.ArgumentParser(prog="dist-trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also accepted after the command)")
    sub = parser.add_subparsers(dest="command", required=True)
    prepare.register(sub)
    _register_train(sub)
    _register_check(sub)
    _register_generate(sub)
    _register_export(sub)
    _register_eval(sub)
    _register_report(sub)
    _register_attention(sub)
    planner_cli.register(sub, check_written=_check_written)
    memory_experiment.register(sub)
    calibrate.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if "--debug" in extra:
        extra.remove("--debug")
        args.debug = True
    if args.command in ("train", "check"):
        bad = [a for a in extra if not (a.startswith("--") and "." in a.split("=")[0] and "=" in a)]
        if bad:
            parser.error(f"unrecognised arguments {bad}; overrides look like --section.field=value")
        args.overrides = extra
    elif extra:
        parser.error(f"unrecognised arguments: {' '.join(extra)}")
    from dist_trainer.files import error_message, first_to_say, refuse_empty_paths

    try:
        refuse_empty_paths(args)
        return args.func(args)
    except (ValueError, OSError) as exc:  # bad input, an unusable path, a full disk: one line (issue 16)

        if args.debug:
            traceback.print_exc()
        # one write of the whole line: the ranks of a torchrun job share stderr, and print() writes the text and
        # its newline separately, so two ranks' lines could interleave; a line another rank printed is not repeated
        line = f"dist-trainer {args.command}: error: {error_message(exc)}\n"
        if first_to_say(line):
            sys.stderr.write(line)
            sys.stderr.flush()
        return 2


if __name__ == "__main__":
    sys.exit(main())
