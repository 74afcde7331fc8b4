"""Hardware profiles: peak FLOP/s, memory, bandwidths and an achievable-efficiency factor.

Peaks are the vendors' dense (no sparsity) tensor-core figures from the data sheets (V100: 125 TFLOP/s fp16,
no bf16, so its 16-bit peak is fp16; A100: 312 bf16 / 19.5 fp32 non-tensor; H100/H200 SXM: 989 bf16 / 67
fp32). Bandwidths are per GPU and per direction: NVLink (V100 150, A100 300, H100/H200 450 GB/s) inside a node,
the node's InfiniBand share per GPU between nodes (V100: 100 Gb/s, A100: 200 Gb/s HDR, H100/H200: 400 Gb/s NDR
per GPU). ``efficiency`` is the fraction of peak a well-tuned transformer step reaches on matmuls (Megatron
reports 40-55% MFU on A100/H100); it is a stated assumption, overridable, not a measurement, as are the ring
latencies (NVLink ~10 us, InfiniBand ~20 us per hop, NCCL's published small-message figures). ``dist-trainer
calibrate`` replaces all of them with measurements of the machine at hand (``experiments/calibrate.py``), written as
a JSON profile that ``--hardware FILE.json`` (plan), ``parallel.hardware`` (layout=auto, MFU) read.

``host_memory_per_gpu`` is the host RAM of the vendor's reference node divided by its GPUs, the planner's
default budget for offloaded states (``plan --host-memory-gb`` overrides it per node): DGX-2, the ZeRO paper's
V100 cluster, 1.5 TB for 16 GPUs; DGX A100 1 TB (40 GB GPUs) or 2 TB (80 GB GPUs) for 8; DGX H100 and
DGX H200 2 TB for 8 (NVIDIA data sheets). A CPU "device" is host memory itself: the same 16 GiB per rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dist_trainer.files import read_json

GiB = 2**30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops_16bit: float  # dense bf16 (fp16 on V100) FLOP/s
    peak_flops_fp32: float
    memory_bytes: int
    intra_node_bw: float  # bytes/s per GPU per direction (NVLink)
    inter_node_bw: float  # bytes/s per GPU per direction (network)
    efficiency: float = 0.5  # achievable fraction of peak on the model's matmuls (large ones: see gemm_knee)
    pcie_bw: float = 25e9  # host <-> device, for offloaded states
    host_adam_params_per_s: float = 1e9  # CPU Adam throughput (DeepSpeed CPUAdam, AVX512, ~1 B params/s/node)
    host_memory_per_gpu: int = 256 * 10**9  # the reference node's host RAM / its GPUs (module docstring)
    gemm_knee: float = 64.0  # a GEMM of r x c outputs reaches efficiency * r/(r+knee) * c/(c+knee) of peak
    intra_node_latency: float = 10e-6  # seconds per hop of a ring collective inside a node (NVLink: ~10 us)
    inter_node_latency: float = 20e-6  # per hop between nodes (InfiniBand: ~20 us with the stack)
    source: str = "data sheets (module docstring)"  # where the figures come from: data sheets or a calibration
    # the collective backend: gloo has no reduce-scatter, so parallel/comm.py all-reduces and keeps a slice there
    backend: str = "nccl"
    # Explicit non-GEMM terms (calibrated profiles): streaming bandwidth for the elementwise work between the GEMMs
    # and the optimizer, and the fixed cost of one kernel launch / CPU op. None: `efficiency` absorbs them.
    memory_bw: float | None = None
    op_overhead: float | None = None
    # Under load (calibrate on the job's ranks at once; experiments/calibrate_load.py). A CPU's ranks share
    # `cores` cores, and the rates above were measured with `ranks_at_once` ranks busy; None: a device per rank.
    cores: int | None = None
    ranks_at_once: int | None = None
    # (n, a, b): a blocking collective of a group of n issued c seconds of compute after the previous one costs
    # a + b c seconds beyond ring_time (peers still computing, or paused by the scheduler). Empty: nothing beyond.
    collective_sync: tuple[tuple[int, float, float], ...] = ()
    # (stage, s, s_micro): DeepSpeed ZeRO's step costs s per parameter per step and s_micro per parameter per
    # micro-batch more than DDP's (never less than 0 in all), beyond the traffic cost.py prices. Empty: nothing.
    zero_overhead: tuple[tuple[int, float, float], ...] = ()

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_16bit

    def matmul_flops(self, precision: str, rows: float, cols: float) -> float:
        """FLOP/s a GEMM with ``rows`` x ``cols`` outputs (tokens x features on this rank) reaches: small ones
        reach less of peak (saturating in both dims); calibrated profiles fit ``efficiency`` and ``gemm_knee``."""
        return self.peak_flops(precision) * self.efficiency * rows / (rows + self.gemm_knee) * cols / (
            cols + self.gemm_knee)

    def scatter_kind(self) -> str:
        """How ``ring_time`` should price a reduce-scatter of our own code on this profile's backend."""
        return "all_reduce" if self.backend == "gloo" else "reduce_scatter"

    def rank_speed(self, ranks_per_node: int) -> float:
        """How much faster (> 1) or slower one rank computes with ``ranks_per_node`` ranks on a node than when this
        profile was measured: on shared cores a rank gets min(1, cores / ranks) of one; 1 with a device per rank."""
        if self.cores is None or self.ranks_at_once is None:
            return 1.0
        return min(1.0, self.cores / ranks_per_node) / min(1.0, self.cores / self.ranks_at_once)

    def oversubscription(self, ranks_per_node: int) -> float:
        """Ranks per core (>= 1): above 1, a rank that waits lends its core to the others."""
        return max(1.0, ranks_per_node / self.cores) if self.cores else 1.0

    def sync_cost(self, n: int, compute_between: float) -> float:
        """Seconds a blocking collective of ``n`` ranks costs beyond ``ring_time`` when ``compute_between`` seconds
        of compute precede it: the fit of the largest measured group size <= n (0 when none is)."""
        fits = [f for f in self.collective_sync if f[0] <= n]
        if n < 2 or not fits:
            return 0.0
        _, a, b = max(fits)
        return a + b * compute_between

    def zero_step_overhead(self, stage: int, params: float, n_microbatches: int) -> float:
        """Seconds DeepSpeed's ZeRO-``stage`` step adds over DDP's for ``params`` parameters (calibrated; else 0)."""
        for s, per_step, per_micro in self.zero_overhead:
            if s == stage:
                return max(0.0, params * (per_step + per_micro * n_microbatches))
        return 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareProfile:
        """A profile written by ``dist-trainer calibrate`` (or by hand: every field of this class, by name)."""
        try:
            data = read_json(Path(path), "not a hardware profile (dist-trainer calibrate writes one)")
        except OSError as exc:
            raise ValueError(f"hardware profile {path} cannot be read: {exc.strerror}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - known or not {"name", "peak_flops_16bit"} <= set(data):
            raise ValueError(f"hardware profile {path} must be a JSON object with the fields of HardwareProfile "
                             f"({', '.join(sorted(known))})")
        for key in ("collective_sync", "zero_overhead"):  # JSON lists back to the tuples the class holds
            data[key] = tuple(tuple(row) for row in data.get(key, ()))
        return cls(**data)

    def host_memory_per_node(self, gpus_per_node: int) -> int:
        """The default host-memory budget of a node of ``gpus_per_node`` GPUs (offloaded states must fit it)."""
        return self.host_memory_per_gpu * gpus_per_node

    def with_memory(self, memory_bytes: int) -> HardwareProfile:
        return replace(self, memory_bytes=memory_bytes)


# A data-sheet GPU's GEMMs: cuBLAS reaches about 0.7-0.8 of the dense tensor-core peak on a transformer's large
# GEMMs (A100 bf16: 220-250 of 312 TFLOP/s) and less on narrow ones: `efficiency` x r/(r + knee) x c/(c + knee),
# r tokens and c features of the rank's GEMM. The elementwise work between them is priced apart, at the HBM
# bandwidth of the data sheet (`memory_bw`; compute.memory_and_overhead). Stated assumptions, fitted once on
# Megatron-LM's Table 1 (benchmarks/megatron_table1.py, docs/planner.md), not per row.
GPU_GEMM_EFFICIENCY = 0.7
GPU_GEMM_KNEE = 128.0


def _gpu(hbm_bytes_per_s: float) -> dict[str, Any]:
    """A data-sheet GPU's GEMM efficiency, GEMM knee and HBM bandwidth (above)."""
    return {"efficiency": GPU_GEMM_EFFICIENCY, "gemm_knee": GPU_GEMM_KNEE, "memory_bw": hbm_bytes_per_s}


def hardware_profiles() -> dict[str, HardwareProfile]:
    """The known profiles by name (a fresh dict: callers may not mutate a shared table)."""
    return {p.name: p for p in (
        HardwareProfile("V100-32GB", 125e12, 15.7e12, 32 * GiB, 150e9, 12.5e9, pcie_bw=12e9,
                        host_memory_per_gpu=1500 * 10**9 // 16, **_gpu(900e9)),
        HardwareProfile("A100-40GB", 312e12, 19.5e12, 40 * GiB, 300e9, 25e9, host_memory_per_gpu=1000 * 10**9 // 8,
                        **_gpu(1555e9)),
        HardwareProfile("A100-80GB", 312e12, 19.5e12, 80 * GiB, 300e9, 25e9, host_memory_per_gpu=2000 * 10**9 // 8,
                        **_gpu(2039e9)),
        HardwareProfile("H100-80GB", 989e12, 67e12, 80 * GiB, 450e9, 50e9, pcie_bw=50e9,
                        host_memory_per_gpu=2000 * 10**9 // 8, **_gpu(3.35e12)),
        HardwareProfile("H200-141GB", 989e12, 67e12, 141 * 10**9, 450e9, 50e9, pcie_bw=50e9,
                        host_memory_per_gpu=2000 * 10**9 // 8, **_gpu(4.8e12)),
        # Meta's Grand Teton H100 (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md): SXM, 96 GB HBM2e at
        # 2.4 TB/s, 400 Gb/s per GPU between hosts, capped at 500 W, where "the actual peak TFLOPs number is between
        # SXM and NVL": the midpoint of 989 (SXM) and 835 (NVL) dense bf16 TFLOP/s, an assumption
        HardwareProfile("H100-96GB-500W", 912e12, 60e12, 96 * GiB, 450e9, 50e9, pcie_bw=50e9,
                        host_memory_per_gpu=2000 * 10**9 // 8, **_gpu(2.4e12)),
        # A CPU "device" for gloo runs: a few cores at ~50 GFLOP/s each, memory copies for intra-node collectives,
        # gloo's TCP loopback latency. A guess: `dist-trainer calibrate` measures the machine at hand.
        HardwareProfile("cpu", 1e11, 1e11, 16 * GiB, 5e9, 1.25e9, efficiency=0.3, pcie_bw=1e12,
                        host_memory_per_gpu=16 * GiB, intra_node_latency=50e-6, inter_node_latency=100e-6,
                        backend="gloo", source="a guess for a few CPU cores; calibrate measures this machine"),
    )}


def get_hardware(name_or_profile: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (``hardware_profiles``), or read from a JSON file (``dist-trainer calibrate --out``)."""
    if isinstance(name_or_profile, HardwareProfile):
        return name_or_profile
    if name_or_profile.endswith(".json"):
        return HardwareProfile.from_json(name_or_profile)
    profiles = hardware_profiles()
    for name, profile in profiles.items():
        if name.lower() == name_or_profile.lower():
            return profile
    raise ValueError(f"unknown hardware {name_or_profile!r}; known: {', '.join(profiles)}")
