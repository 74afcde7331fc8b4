"""Every command the README, docs/launching.md and docs/planner.md show, run as a user would type it.

The test reads the documents themselves: each command of a fenced ``bash`` block (continuation lines
joined, trailing comments dropped) runs in a scratch workspace that looks like a checkout (configs/,
launch/, benchmarks/, the Makefile and .venv linked in), in document order, so `generate` reads the
checkpoint the README's own training lines wrote and the trainer reads the data the README's own
`prepare` line wrote. Commands are scaled down only by arguments appended to them (a few steps with
evaluation and a checkpoint inside them; less text to tokenize; one benchmark round), and must exit 0;
a failure names the document line. A command that needs what this machine does not have (a cluster,
Docker, GPUs) is listed in NOT_RUN with the reason; a command no rule knows fails the test, so a new
line in a document is run (or explained) without anyone remembering to add it here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dist_trainer.testing import free_port
from tests.conftest import reversal_pairs
from tests.helpers import ROOT, subprocess_env

DOCS = ("README.md", "docs/launching.md", "docs/planner.md")
LINKED = ("configs", "launch", "benchmarks", "scripts", "requirements", "Makefile", "pyproject.toml", ".venv")

# 2 optimizer steps, evaluation and a checkpoint at step 2 (one global batch of validation text)
TRAIN_SCALE = "--train.max_steps=2 --train.eval_every=2 --train.save_every=2 --train.eval_batches=1"
PREPARE_SCALE = "--max-bytes 1000000"  # 1 MB of text instead of 12 MB
SUMMARY = ("=== dist-trainer summary ===", "eval loss")  # what every training command prints on rank 0


@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Run:
    """How to run a command: arguments appended, text its output must contain, a follow-up check."""

    append: str = ""
    expect: tuple[str, ...] = ()
    then: Callable[[Path, dict[str, str]], None] | None = field(default=None, compare=False)
    timeout: int = 600


def _strip_comment(line: str) -> str:
    """Drop a trailing ``# comment`` that is outside quotes and follows whitespace."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands(doc: str) -> list[DocCommand]:
    """The commands of every ```bash block of ``doc``, continuation lines joined, comments dropped."""
    commands: list[DocCommand] = []
    in_block, text, start = False, "", 0
    for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block and line[3:].strip() in ("bash", "sh")
            continue
        if not in_block:
            continue
        body = _strip_comment(line)
        if not text and not body.strip():
            continue
        if not text:
            start = n
        if body.endswith("\\"):
            text += body[:-1].strip() + " "
            continue
        commands.append(DocCommand(doc, start, (text + body.strip()).strip()))
        text = ""
    return commands


# ---------------------------------------------------------------- what is not run here, and why

NOT_RUN: list[tuple[str, str]] = [
    (r"^make test\b", "the suite itself: CI runs it through .ci/run"),
    (r"^docker ", "needs a Docker engine (none here); tests/test_docker.py lints both images and their install path"),
    (r"\bsbatch\b", "needs a SLURM cluster; tests/test_launch.py runs launch/slurm.sbatch with stand-in srun/scontrol"),
    (r"NNODES=2|--num_machines 2|NO_SSH=1|HOSTFILE=",
     "needs several hosts; tests/test_multinode.py runs torchrun.sh and deepspeed.sh on two network namespaces"),
    (r"^launch/deepspeed\.sh --config", "a GPU node (one process per GPU); on CPU the launcher needs NUM_GPUS=N, "
                                         "the next line of the document, which runs"),
    (r"pytest tests/test_multinode\.py", "a test of this suite (needs root for network namespaces); make test runs it"),
]


# ---------------------------------------------------------------- how the others run


def _run_small_plan(ws: Path, env: dict[str, str]) -> None:
    """The same `plan --out` for a world this machine has, then the launch.sh it wrote (one node, 2 processes)."""
    out = ws / "plan-small"
    if not (ws / "data" / "default" / "meta.json").is_file():  # run alone (-k), before the README's prepare
        _shell("dist-trainer prepare --out data/default --vocab-size 4096 --max-bytes 2M", ws, env)
    _shell(f"dist-trainer plan --model tiny --gpus 2 --gpus-per-node 2 --gpu-memory-gb 4 --hardware cpu "
           f"--seq-len 128 --global-batch 16 --out {out} --force", ws, env)
    proc = _shell(f"bash {out}/launch.sh {TRAIN_SCALE} --train.out_dir=runs/plan-small", ws, env)
    for text in SUMMARY:
        assert text in proc.stdout, f"plan-small/launch.sh: {text!r} not printed\n{proc.stdout[-2000:]}"


def _check_export(ws: Path, env: dict[str, str]) -> None:
    assert (ws / "export" / "model.safetensors").is_file() and (ws / "export" / "config.json").is_file()


def _check_merged_export(ws: Path, env: dict[str, str]) -> None:
    """`export --merge-lora`: a plain model (no adapter tensors, a config without LoRA)."""
    from safetensors import safe_open

    out = ws / "export-lora"
    assert json.loads((out / "config.json").read_text())["lora_rank"] == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.keys() and not any("lora_" in k for k in f.keys())


def _check_hf_export(ws: Path, env: dict[str, str]) -> None:
    """The merged LoRA export of the README's Hugging Face section loads into transformers, key for key."""
    import transformers

    out = ws / "export" / "llama-lora"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (out / "tokenizer.json").is_file()


def _check_adapter_export(ws: Path, env: dict[str, str]) -> None:
    config = json.loads((ws / "export" / "llama-adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"], config
    assert (ws / "export" / "llama-adapter" / "adapter_model.safetensors").is_file()


def _write_hf_llama(folder: Path, corpus: Path) -> None:
    """What `models/llama` stands for in the README: a tiny random Llama saved by transformers in shards, with a
    BPE tokenizer (BOS/EOS in its tokenizer_config.json) trained on the workspace's corpus."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(p) for p in sorted(corpus.iterdir())],
              trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"]))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100KB")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False,
         "chat_template": CHAT_TEMPLATE}))


# `models/llama`'s chat template (README's chat section): plain text turns, the assistant's closed by EOS, no
# {% generation %} marks (as most published templates): prepare finds the answers by rendering prefixes
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] + '\\n' }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}")


def write_chat(path: Path, corpus: Path, n: int = 600) -> None:
    """`chat.jsonl` (README's chat section): conversations of the corpus's lines, every fifth a prompt/completion."""
    lines = [" ".join(x.split()) for p in sorted(corpus.iterdir()) for x in p.read_text().splitlines() if x.split()]
    with open(path, "w") as f:
        for i in range(n):
            user, answer = lines[i % len(lines)][:80], lines[(7 * i + 3) % len(lines)][:80]
            f.write(json.dumps({"prompt": user, "completion": answer} if i % 5 == 0 else {"messages": [
                {"role": "system", "content": "answer with a line of Python"}, {"role": "user", "content": user},
                {"role": "assistant", "content": answer}]}) + "\n")


def _check_report(ws: Path, env: dict[str, str]) -> None:
    pngs = {p.name for p in (ws / "runs" / "watch" / "report").glob("*.png")}
    assert {"loss.png", "lr.png", "grad_norm.png", "throughput.png"} <= pngs, pngs


def _check_attention(ws: Path, env: dict[str, str]) -> None:
    out = ws / "runs" / "watch" / "attention"
    assert (out / "attention.json").is_file() and list(out.glob("attention_layer*.png")), sorted(out.iterdir())


def _check_int8_export(ws: Path, env: dict[str, str]) -> None:
    """`export --quantize int8`: the layer linears' weights in int8, each with its fp32 scales beside it."""
    import torch
    from safetensors import safe_open

    with safe_open(str(ws / "export" / "demo-int8" / "model.safetensors"), "pt") as f:
        scales = [k for k in f.keys() if k.endswith(".weight_scale")]
        assert scales and all(f.get_tensor(k.removesuffix("_scale")).dtype == torch.int8 for k in scales)


def _check_memory_experiment(ws: Path, env: dict[str, str]) -> None:
    rows = json.loads((ws / "runs" / "zero_memory" / "memory.json").read_text())
    assert rows, "memory.json is empty"


RUN: list[tuple[str, Run]] = [
    (r"^make demo\b", Run(append=f'PREPARE_ARGS="{PREPARE_SCALE}" DEMO_ARGS="{TRAIN_SCALE}"', expect=SUMMARY)),
    (r"^dist-trainer prepare\b.*--chat\b", Run(expect=("covered by the loss",))),  # a small chat.jsonl already
    (r"^dist-trainer prepare\b", Run(append=PREPARE_SCALE)),
    (r"--train\.resume=true", Run(append=f"{TRAIN_SCALE} --train.max_steps=4", expect=SUMMARY)),
    (r"\bdist_trainer\.cli train\b|^dist-trainer train\b|launch/(torchrun|deepspeed)\.sh\b",
     Run(append=TRAIN_SCALE, expect=SUMMARY)),
    (r"^dist-trainer export\b.*--quantize int8", Run(then=_check_int8_export)),
    (r"^dist-trainer eval\b", Run(expect=("over the first",))),
    (r"^dist-trainer export\b.*--merge-lora", Run(then=_check_merged_export)),
    (r"^dist-trainer export\b.*--adapter", Run(then=_check_adapter_export)),
    (r"^dist-trainer export\b.*export/llama-lora", Run(then=_check_hf_export)),
    (r"^dist-trainer export\b", Run(then=_check_export)),
    (r"^(\w+=\S+ )*dist-trainer plan\b.*--verify\b", Run(append="--verify-steps 3", expect=("verified the top",))),
    (r"^dist-trainer plan\b.*--out\b", Run(then=_run_small_plan)),
    (r"^dist-trainer (generate|params|memory|plan|calibrate)\b", Run()),
    (r"^dist-trainer check\b", Run(expect=("ok: ",))),
    (r"^dist-trainer memory-experiment\b", Run(then=_check_memory_experiment)),
    (r"^dist-trainer report\b", Run(then=_check_report)),
    (r"^dist-trainer attention\b", Run(then=_check_attention)),
    (r"benchmarks/(trainer_overhead|zero_overhead|moe_dispatch)\.py", Run(append="--steps 3 --rounds 1")),
    (r"benchmarks/health_overhead\.py", Run(append="--steps 3 --rounds 1 --every 2")),
    (r"benchmarks/tp_comm\.py", Run(append="--steps 2")),
    (r"benchmarks/pipeline_bubble\.py", Run(append="--steps 1 --d-model 128 --seq 64 --layers 4")),
    # the project's kernel cache (subprocess_env): the benchmark's default, an empty one, compiles from scratch
    (r"benchmarks/compile_speed\.py",
     Run(append='--models demo --steps 1 --rounds 1 --cache "$TORCHINDUCTOR_CACHE_DIR"')),
    (r"benchmarks/planner_accuracy\.py", Run(append="--quick")),
    (r"benchmarks/planner_time\.py", Run(append="--quick --steps 3")),
    (r"benchmarks/collective_wait\.py", Run(append="--repeats 3", expect=("x back to back",))),
    (r"benchmarks/gpu_check\.py", Run(append="--device cpu --smoke --out runs/gpu_check.json")),
    (r"benchmarks/megatron_table1\.py", Run()),
    (r"benchmarks/published_runs\.py", Run(expect=("torchtitan Llama 3.1 8B",))),
    (r"benchmarks/planner_speed\.py", Run(append="--repeat 1")),
    (r"benchmarks/cp_comm\.py", Run(append="--seq 512 --cp 2")),
    (r"benchmarks/document_masking\.py", Run(append="--models demo --steps 1 --rounds 1")),
    (r"benchmarks/low_bit\.py", Run(append="--steps 3 --lora-steps 3", expect=("int8 export",))),
]


def rule_for(command: DocCommand) -> Run | str | None:
    """The Run for ``command``, the reason it is not run here (a str), or None when no rule knows it."""
    for pattern, reason in NOT_RUN:
        if re.search(pattern, command.text):
            return reason
    for pattern, run in RUN:
        if re.search(pattern, command.text):
            return run
    return None


ALL = [c for doc in DOCS for c in doc_commands(doc)]
RUNNABLE = [c for c in ALL if isinstance(rule_for(c), Run)]


def group_of(command: DocCommand) -> str:
    """Which of three independent sequences a command runs in, each in its own workspace and test module (so
    ``make test``'s pytest-xdist workers can run them side by side): the benchmarks (they make their own inputs;
    ``test_doc_benchmarks.py``), the guides (docs/launching.md, docs/planner.md; ``test_doc_guides.py``), and the
    README's other commands in its order (here)."""
    if re.search(r"\bbenchmarks/", command.text):
        return "benchmarks"
    return "readme" if command.doc == "README.md" else "guides"


def _shell(command: str, cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"`{command}` exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                  f"stderr:\n{proc.stderr[-3000:]}")
    return proc


def workspace_fixture(group: str) -> Any:
    """A module-scoped fixture: the workspace of one command group (``group_of``)."""
    @pytest.fixture(scope="module")
    def workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
        return _workspace(tmp_path_factory.mktemp(f"docs-{group}"))
    return workspace


workspace = workspace_fixture("readme")


def _workspace(ws: Path) -> tuple[Path, dict[str, str]]:
    """A folder that looks like a checkout, with the inputs the documents' commands name."""
    for name in LINKED:
        (ws / name).symlink_to(ROOT / name)
    # `dist-trainer prepare --input corpus/ more.jsonl`: a folder of text and a JSONL file
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (ws / "corpus").mkdir()
    for name in ("textwrap.py", "shlex.py", "glob.py"):
        shutil.copy(stdlib / name, ws / "corpus" / name)
    (ws / "more.jsonl").write_text("".join(json.dumps({"text": (stdlib / n).read_text()}) + "\n"
                                          for n in ("fnmatch.py", "bisect.py")))
    _write_hf_llama(ws / "models" / "llama", ws / "corpus")  # `models/llama`: README's Hugging Face section
    reversal_pairs(ws / "pairs.jsonl")  # `prepare --input pairs.jsonl --pairs`: README's encoder-decoder section
    write_chat(ws / "chat.jsonl", ws / "corpus")  # `prepare --chat chat.jsonl`: README's chat section
    # `--config run.yaml` (docs/launching.md): a user's run config; the demo's is one
    shutil.copy(ROOT / "configs" / "runs" / "demo.yaml", ws / "run.yaml")
    env = subprocess_env(ws, TORCH_EXTENSIONS_DIR=str(ROOT / ".torch_extensions"))
    env.pop("WANDB_MODE")  # the default a user gets: offline, under the run folder
    env.update(WANDB_CACHE_DIR=str(ws / ".wandb-cache"), WANDB_CONFIG_DIR=str(ws / ".wandb-config"))
    return ws, env


def test_every_documented_command_is_run_or_says_why_not() -> None:
    """Each command of the documents has a rule; those not run here are listed with their reason."""
    unknown = [c.where + ": " + c.text for c in ALL if rule_for(c) is None]
    assert not unknown, "commands no rule in tests/test_doc_commands.py knows (add one):\n" + "\n".join(unknown)
    assert len(RUNNABLE) >= 25, len(RUNNABLE)  # the documents' runnable commands are found, not silently dropped
    for c in ALL:
        rule = rule_for(c)
        if isinstance(rule, str):
            print(f"not run: {c.where}: {c.text}\n    because {rule}")


def run_documented(command: DocCommand, ws: Path, env: dict[str, str]) -> None:
    """Run one documented command in its group's workspace as its rule says; assert what the rule expects."""
    if group_of(command) == "guides" and not (ws / "data" / "default" / "meta.json").is_file():
        # the guides train on the README's default data (configs/runs/demo.yaml); its prepare line runs in the
        # README's own workspace, so the guides' workspace prepares the same once
        _shell(f"dist-trainer prepare --out data/default --vocab-size 4096 {PREPARE_SCALE}", ws, env)
    rule = rule_for(command)
    assert isinstance(rule, Run)
    line = f"{command.text} {rule.append}".strip()
    # a free rendezvous port for launchers that default to 29500 (a command that sets its own keeps it)
    env = {**env, "MASTER_PORT": str(free_port())}
    proc = subprocess.run(["bash", "-c", line], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=rule.timeout)
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{command.where}: `{line}` exited {proc.returncode}\n{tail}"
    for text in rule.expect:
        assert text in proc.stdout, f"{command.where}: `{line}` did not print {text!r}\n{tail}"
    if rule.then is not None:
        rule.then(ws, env)
    last = next((x for x in reversed(proc.stdout.splitlines()) if x.strip()), "")
    print(f"{command.where}: {command.text}\n    last output: {last}")


def in_group(group: str) -> Any:
    """``parametrize`` over the runnable commands of ``group``, each named by its document line."""
    commands = [c for c in RUNNABLE if group_of(c) == group]
    return pytest.mark.parametrize("command", commands, ids=[c.where for c in commands])


@pytest.mark.slow
@in_group("readme")
def test_documented_command_runs(command: DocCommand, workspace: tuple[Path, dict[str, str]]) -> None:
    run_documented(command, *workspace)
