"""Hardware profiles: peak FLOP/s, memory, bandwidths and an achievable-efficiency factor.

Peaks are the vendors' dense (no sparsity) tensor-core figures from the data sheets (V100: 125 TFLOP/s fp16,
no bf16, so its 16-bit peak is fp16; A100: 312 bf16 / 19.5 fp32 non-tensor; H100/H200 SXM: 989 bf16 / 67
fp32). Bandwidths are per GPU and per direction: NVLink (V100 150, A100 300, H100/H200 450 GB/s) inside a node,
the node's InfiniBand share per GPU between nodes (V100: 100 Gb/s, A100: 200 Gb/s HDR, H100/H200: 400 Gb/s NDR
per GPU). ``efficiency`` is the fraction of peak a well-tuned transformer step reaches on matmuls (Megatron
reports 40-55% MFU on A100/H100); it is a stated assumption, overridable, not a measurement.

``host_memory_per_gpu`` is the host RAM of the vendor's reference node divided by its GPUs, the planner's
default budget for offloaded states (``plan --host-memory-gb`` overrides it per node): DGX-2, the ZeRO paper's
V100 cluster, 1.5 TB for 16 GPUs; DGX A100 1 TB (40 GB GPUs) or 2 TB (80 GB GPUs) for 8; DGX H100 and
DGX H200 2 TB for 8 (NVIDIA data sheets). A CPU "device" is host memory itself: the same 16 GiB per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 2**30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops_16bit: float  # dense bf16 (fp16 on V100) FLOP/s
    peak_flops_fp32: float
    memory_bytes: int
    intra_node_bw: float  # bytes/s per GPU per direction (NVLink)
    inter_node_bw: float  # bytes/s per GPU per direction (network)
    efficiency: float = 0.5  # achievable fraction of peak on the model's matmuls
    pcie_bw: float = 25e9  # host <-> device, for offloaded states
    host_adam_params_per_s: float = 1e9  # CPU Adam throughput (DeepSpeed CPUAdam, AVX512, ~1 B params/s/node)
    host_memory_per_gpu: int = 256 * 10**9  # the reference node's host RAM / its GPUs (module docstring)

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_16bit

    def host_memory_per_node(self, gpus_per_node: int) -> int:
        """The default host-memory budget of a node of ``gpus_per_node`` GPUs (offloaded states must fit it)."""
        return self.host_memory_per_gpu * gpus_per_node

    def with_memory(self, memory_bytes: int) -> HardwareProfile:
        return replace(self, memory_bytes=memory_bytes)


def hardware_profiles() -> dict[str, HardwareProfile]:
    """The known profiles by name (a fresh dict: callers may not mutate a shared table)."""
    return {p.name: p for p in (
        HardwareProfile("V100-32GB", 125e12, 15.7e12, 32 * GiB, 150e9, 12.5e9, pcie_bw=12e9,
                        host_memory_per_gpu=1500 * 10**9 // 16),
        HardwareProfile("A100-40GB", 312e12, 19.5e12, 40 * GiB, 300e9, 25e9, host_memory_per_gpu=1000 * 10**9 // 8),
        HardwareProfile("A100-80GB", 312e12, 19.5e12, 80 * GiB, 300e9, 25e9, host_memory_per_gpu=2000 * 10**9 // 8),
        HardwareProfile("H100-80GB", 989e12, 67e12, 80 * GiB, 450e9, 50e9, pcie_bw=50e9,
                        host_memory_per_gpu=2000 * 10**9 // 8),
        HardwareProfile("H200-141GB", 989e12, 67e12, 141 * 10**9, 450e9, 50e9, pcie_bw=50e9,
                        host_memory_per_gpu=2000 * 10**9 // 8),
        # A CPU "device" for gloo runs: a few cores at ~50 GFLOP/s each, memory copies for intra-node collectives.
        HardwareProfile("cpu", 1e11, 1e11, 16 * GiB, 5e9, 1.25e9, efficiency=0.3, pcie_bw=1e12,
                        host_memory_per_gpu=16 * GiB),
    )}


def get_hardware(name_or_profile: str | HardwareProfile) -> HardwareProfile:
    if isinstance(name_or_profile, HardwareProfile):
        return name_or_profile
    profiles = hardware_profiles()
    for name, profile in profiles.items():
        if name.lower() == name_or_profile.lower():
            return profile
    raise ValueError(f"unknown hardware {name_or_profile!r}; known: {', '.join(profiles)}")
