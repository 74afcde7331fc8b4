"""The Docker images built and run, not only linted: scripts/build_image.sh builds docker/Dockerfile.cpu, and
docker/Dockerfile with its CUDA parts off (CUDA_OPS=0), with buildah on a local Debian base; each image then runs
as `docker run` would (scripts/build_image.sh run: its ENTRYPOINT, USER, WORKDIR and ENV).

In each image, as its non-root user: `dist-trainer params --model gpt2` prints the published count, the launch
scripts are on PATH, and the image holds the sources only (no tests, .venv, runs/, data, nor anything of the pip
mirror the build used). In the CPU image: a 2-process gloo run of the tiny preset (launch/torchrun.sh, as the README
runs it) writes its checkpoint into a mounted /workspace, and `dist-trainer export` reads it back.

Minutes and root (buildah): marked `image`, so `make test` leaves it out; CI runs it after the suite
(`.ci/run`: `make test-image`). Here: `.venv/bin/python -m pytest -m image tests/test_image.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.test_model import PUBLISHED

pytestmark = pytest.mark.image

SCRIPT = ROOT / "scripts" / "build_image.sh"
BUILD_TIMEOUT_S = 1800  # a clean build: debootstrap, then torch and DeepSpeed into the image
RUN_TIMEOUT_S = 300
SOURCES = Path("/opt/dist_trainer")  # WORKDIR of the install in both Dockerfiles
# What the build context must never bring into an image (.dockerignore): tests and their data, local
# environments, run output, the image cache itself.
NOT_IN_IMAGE = ("tests", "benchmarks", ".venv", "runs", "data", "wandb", ".git", ".image", ".tmp", ".torch_extensions")


@dataclass(frozen=True)
class Image:
    target: str  # scripts/build_image.sh target
    tag: str


IMAGES = [Image("cpu", "localhost/dist-trainer:cpu"), Image("cuda", "localhost/dist-trainer:cuda-check")]


def _script(*args: str, timeout: int = RUN_TIMEOUT_S, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"scripts/build_image.sh {' '.join(args)} exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def _run(image: Image, *args: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`docker run --rm OPTIONS IMAGE ARGS` (OPTIONS: -v HOST:CTR, -e VAR=VALUE, --entrypoint CMD)."""
    return _script("run", *options, image.tag, *args)


_BUILT: dict[Image, str] = {}  # image -> "" once built, else why its build failed


def _build(img: Image) -> Image:
    """Built once per session from this checkout's files (buildah's layer cache makes an unchanged rebuild quick);
    a failed build fails every test of that image without building it again."""
    if img not in _BUILT:
        try:
            proc = _script(img.target, timeout=BUILD_TIMEOUT_S, env={**os.environ, "IMAGE_TAG": img.tag})
            _BUILT[img] = "" if f"image {img.tag}: " in proc.stdout else f"no size line:\n{proc.stdout[-2000:]}"
        except (AssertionError, subprocess.TimeoutExpired) as e:
            _BUILT[img] = str(e)
    if _BUILT[img]:
        pytest.fail(f"building {img.tag} failed: {_BUILT[img]}")
    return img


@pytest.fixture(scope="module", params=IMAGES, ids=lambda i: i.target)
def image(request: pytest.FixtureRequest) -> Image:
    return _build(request.param)


def _config(image: Image, field: str) -> str:
    return _script("buildah", "inspect", "--type", "image", "--format", "{{.OCIv1.Config." + field + "}}",
                   image.tag).stdout.strip()


def test_runs_the_planner_as_its_non_root_user(image: Image) -> None:
    """Through the ENTRYPOINT, as `docker run IMAGE params --model gpt2` (README): GPT-2's published count."""
    user = _config(image, "User")
    assert user and user.split(":")[0] not in ("", "0", "root"), f"image user {user!r}"
    assert _run(image, "-u", options=("--entrypoint", "id")).stdout.strip() == user.split(":")[0]
    out = _run(image, "params", "--model", "gpt2").stdout
    total = next((line for line in out.splitlines() if line.startswith("total")), "")
    assert f"{PUBLISHED['gpt2']:,}" in total.split(), out[-2000:]


def test_launch_scripts_on_path_and_workspace_writable(image: Image) -> None:
    probe = ("command -v torchrun.sh && command -v deepspeed.sh && touch /workspace/.probe && rm /workspace/.probe "
             "&& pwd && launch_help=$(torchrun.sh --help) && echo \"$launch_help\" | head -n1")
    out = _run(image, "-c", probe, options=("--entrypoint", "sh")).stdout.splitlines()
    assert out[:2] == [str(SOURCES / "launch" / "torchrun.sh"), str(SOURCES / "launch" / "deepspeed.sh")], out
    assert out[2] == "/workspace", out
    assert out[3].startswith("Usage: launch/torchrun.sh"), out


def test_holds_the_sources_only(image: Image) -> None:
    # token shards as `prepare` names them, the suite's files, a venv anywhere
    listing = (f"ls -A {SOURCES}; echo ---; find / -xdev \\( -name .venv -o -name 'train_[0-9]*.bin' "
               f"-o -name 'val_[0-9]*.bin' \\) -print; find {SOURCES} -name 'test_*.py' -print; echo ---; "
               "find /tmp -mindepth 2 -print; echo ---; /opt/venv/bin/python -m pip config list")
    parts = _run(image, "-c", listing, options=("--user", "0", "--entrypoint", "sh")).stdout.split("---\n")  # all of /
    top, strays, tmp, pip_config = (p.split() for p in parts)
    assert "dist_trainer" in top and "launch" in top and "configs" in top, top
    assert not set(top) & set(NOT_IN_IMAGE), f"{SOURCES} holds {sorted(set(top) & set(NOT_IN_IMAGE))}"
    assert strays == [], f"environments, token shards or test files in the image: {strays}"
    # the build's pip mirror was mounted under /tmp/build-pip for the RUN steps only: its mount points stay empty
    assert tmp == [] or all(p.startswith("/tmp/build-pip/") and p.count("/") == 3 for p in tmp), tmp
    # no pip configuration of the host (index, find-links, CA bundle) baked in; PIP_NO_CACHE_DIR is the image's ENV
    assert [c for c in pip_config if not c.startswith(":env:.no-cache-dir=")] == [], pip_config
    # nor in the image's history, which records every build argument's value (an index URL may carry a token):
    # the sources came in a mounted pip.conf, and the history names only its path
    history = _script("buildah", "inspect", "--type", "image", "--format",
                      "{{range .Docker.History}}{{println .CreatedBy}}{{end}}", image.tag).stdout
    assert "PIP_CONFIG_FILE=/tmp/build-pip/conf/pip.conf" in history, history[-3000:]
    recorded = {k: v for k, v in re.findall(r"\bPIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS|CERT)=(\S*)", history) if v}
    assert recorded == {}, f"pip sources recorded in the image's history: {recorded}"
    host = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for source in re.findall(r"\.(?:index-url|extra-index-url|find-links|cert)='(.*)'", host):
        for item in source.split():
            assert item not in history, f"the host's pip source {item} is in the image's history"


@pytest.fixture(scope="module")
def cpu_image() -> Image:
    return _build(IMAGES[0])


def test_cpu_image_trains_into_mounted_workspace_and_exports(cpu_image: Image, tmp_path: Path) -> None:
    """2 gloo processes (torchrun.sh, NPROC_PER_NODE=2) train the tiny preset for 3 steps on text the image's own
    `prepare` wrote; the checkpoint lands in the mounted folder, owned by the image's user, and `export` reads it."""
    import torch
    from safetensors.torch import load_file

    from dist_trainer.checkpoint.source import HFSource, open_source

    work = tmp_path / "workspace"
    work.mkdir()
    uid, _, gid = _config(cpu_image, "User").partition(":")
    os.chown(work, int(uid), int(gid or uid))  # as a user gives the container a folder it owns
    mount = ("-v", f"{work}:/workspace")
    _run(cpu_image, "prepare", "--out", "/workspace/data", "--vocab-size", "4096",
         "--max-bytes", "1M", "--val-fraction", "0.1", options=mount)
    steps = 3
    train = _run(cpu_image, "--config", str(SOURCES / "configs" / "runs" / "demo.yaml"), "--data.path=/workspace/data",
                 "--train.out_dir=/workspace/run", f"--train.max_steps={steps}", f"--train.eval_every={steps}",
                 f"--train.save_every={steps}", "--train.log_every=1", "--data.seq_len=64",
                 "--parallel.micro_batch_size=2", "--parallel.global_batch_size=4",
                 options=(*mount, "-e", "NPROC_PER_NODE=2", "--entrypoint", "torchrun.sh"))
    log = train.stdout + train.stderr
    assert "model tiny:" in log and "world 2 (torchrun)" in log, log[-3000:]
    run = work / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), records
    step_dir = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["step"] == steps and meta["layout"]["world"] == 2 and meta["layout"]["dp"] == 2, meta
    assert step_dir.stat().st_uid == int(uid), "the checkpoint is not the image user's"

    # export's default (a Hugging Face folder, HF names) and --format native (our names), each read back against
    # the checkpoint's own tensors (dp=2, no TP or stages: one full model file)
    saved = torch.load(step_dir / "model_tp00_pp00.pt", map_location="cpu", weights_only=True)
    _run(cpu_image, "export", "--checkpoint", "/workspace/run", "--out", "/workspace/hf", options=mount)
    hf = open_source(work / "hf")
    assert isinstance(hf, HFSource), f"export wrote no Hugging Face folder: {sorted(os.listdir(work / 'hf'))}"
    assert hf.names() == saved.keys(), sorted(hf.names() ^ saved.keys())
    for name, tensor in saved.items():
        assert torch.equal(hf.read(name), tensor), f"export changed {name}"
    _run(cpu_image, "export", "--format", "native", "--checkpoint", "/workspace/run", "--out", "/workspace/native",
         options=mount)
    native = load_file(str(work / "native" / "model.safetensors"))
    assert native.keys() == saved.keys(), sorted(set(native) ^ set(saved))
    for name, tensor in saved.items():
        assert torch.equal(native[name], tensor), f"export --format native changed {name}"
    assert json.loads((work / "native" / "config.json").read_text())["preset"] == "tiny"
