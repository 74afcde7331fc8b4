"""Who am I, on which device, talking over which backend: read from whichever launcher started us.

torchrun/torchelastic, the ``deepspeed`` launcher and ``accelerate launch`` all export
RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT). A bare ``srun`` exports
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID instead, and Open MPI its OMPI_COMM_WORLD_*
variables. The device follows the local rank (cuda:LOCAL_RANK on GPU nodes); the backend
follows the device (nccl on CUDA, gloo on CPU) unless the config names one.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank started by hand (RANK/WORLD_SIZE without a launcher) waits this long for the others; a launcher starts
# them together. DIST_TRAINER_CONNECT_TIMEOUT_S overrides it.
CONNECT_TIMEOUT_S = 30.0

# (rank, world size, local rank, local world size) variable names, by launcher, in lookup order.
_LAUNCHER_VARS = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "TORCHELASTIC_RUN_ID"),
    ("deepspeed", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"), "CROSS_RANK"),
    ("accelerate", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "ACCELERATE_DYNAMO_BACKEND"),
    ("env", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "RANK"),
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"), "SLURM_PROCID"),
    ("mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"), "OMPI_COMM_WORLD_RANK"),
)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # torchrun | deepspeed | accelerate | env | slurm | mpi | none
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank, world and local rank from the launcher's variables; one process when none is set."""
    env = os.environ if environ is None else environ
    for name, (rank_var, world_var, local_var, local_world_var), marker in _LAUNCHER_VARS:
        if marker not in env or rank_var not in env:
            continue
        try:
            rank = int(env[rank_var])
            world = int(env.get(world_var, "1"))
            local = int(env.get(local_var, "0"))
            # SLURM_NTASKS_PER_NODE may read "4(x2)"; its first number is this node's count
            local_world = int(str(env.get(local_world_var, world)).split("(")[0])
        except ValueError as exc:
            raise ValueError(f"{name} launcher variables are not integers: {exc}") from exc
        if not 0 <= rank < world or not 0 <= local < max(local_world, 1):
            raise ValueError(
                f"{name} launcher gave rank {rank} of world {world}, local rank {local} of {local_world}"
            )
        return LaunchEnv(name, rank, world, local, local_world)
    return LaunchEnv("none", 0, 1, 0, 1)


def pick_device(requested: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is asked for or available (with ``auto``), else cpu."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device=cuda but CUDA is not available on this machine; use cpu or auto")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"local rank {local_rank} has no GPU: this node has {count}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def pick_backend(device: torch.device, requested: str | None) -> str:
    if requested is not None:
        if requested == "nccl" and device.type != "cuda":
            raise ValueError("train.backend=nccl needs CUDA devices; use gloo on CPU")
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(env: LaunchEnv, device: torch.device, backend: str | None, timeout_s: float,
                     single_process_group: bool = False) -> bool:
    """Create the default process group (a no-op when one exists); return whether one exists now.

    One process gets no group, unless ``single_process_group``: DeepSpeed's ZeRO engine needs
    ``torch.distributed`` even for one rank, so that regime gets a one-rank group on an
    in-memory store (no port, no rendezvous). ``timeout_s`` bounds every collective: a dead or
    stalled peer makes the survivors fail with an error instead of hanging forever.
    """
    if dist.is_initialized():
        return True
    if not env.distributed:
        if not single_process_group:
            return False
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asserts it (runtime/engine.py, args check)
        dist.init_process_group(pick_backend(device, backend), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
        return True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if env.launcher in ("slurm", "mpi"):  # init_method env:// reads these
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    store = _bare_env_store(env, timeout_s) if env.launcher == "env" else None
    dist.init_process_group(
        pick_backend(device, backend), rank=env.rank, world_size=env.world_size, store=store,
        timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None,
    )
    return True


def _bare_env_store(env: LaunchEnv, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store when RANK/WORLD_SIZE are set but no launcher is known (a shell that exported them, a
    hand-started rank): every rank must reach it within CONNECT_TIMEOUT_S, else one message naming the address and
    what to run. It used to wait the whole parallel.timeout_s in silence, then raise a DistNetworkError (issue 28)."""
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    connect_s = min(timeout_s, float(os.environ.get("DIST_TRAINER_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S)))
    try:
        if env.rank != 0:  # reach the port first: c10d's own failed connect logs a C++ stack trace on stderr
            _wait_for_port(addr, int(port), connect_s)
        store = dist.TCPStore(addr, int(port), env.world_size, is_master=env.rank == 0,
                              timeout=timedelta(seconds=connect_s), wait_for_workers=True)
    except (OSError, RuntimeError, ValueError, dist.DistError) as exc:
        waited = (f"waited {connect_s:g}s for the other {env.world_size - 1} rank(s) to connect to it"
                  if env.rank == 0 else f"could not reach rank 0's store there within {connect_s:g}s")
        raise ValueError(
            f"rank {env.rank} of WORLD_SIZE={env.world_size}: no rendezvous at MASTER_ADDR={addr} "
            f"MASTER_PORT={port} ({waited}): RANK and WORLD_SIZE are set but no launcher started the other "
            f"ranks. Start every rank with torchrun (torchrun --nproc-per-node={env.world_size} -m dist_trainer.cli "
            f"train ..., or launch/torchrun.sh), or unset RANK and WORLD_SIZE to train in one process "
            f"({type(exc).__name__})") from exc
    store.set_timeout(timedelta(seconds=timeout_s))  # later waits (gloo's connections) get the run's timeout
    return store


def _wait_for_port(addr: str, port: int, seconds: float) -> None:
    """Return once ``addr:port`` accepts a connection; TimeoutError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{addr}:{port} refused or did not answer") from None
            time.sleep(0.1)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
