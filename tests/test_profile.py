"""train.profile_steps and train.memory_snapshot (train/profile.py): their checks before launch, and the step split
read off a trace (train/profile_split.py) on a trace whose every part is known. The profiled 2-rank runs are in
tests/test_plan_check.py, which shares their spawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_trainer.train.profile_split import split_trace
from dist_trainer.train.trainer import Trainer
from tests.helpers import tiny_config


@pytest.mark.parametrize("steps", ["4-3", "0-2", "3-11", "3:4", "a-b", "2-3-4", "4"])
def test_a_bad_profile_range_is_refused_naming_it(tiny_data: Path, tmp_path: Path, steps: str) -> None:
    with pytest.raises(ValueError, match=rf"train.profile_steps='{steps}'"):
        tiny_config(tiny_data, tmp_path, train={"profile_steps": steps})  # max_steps 10
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_a_profile_range_reads_as_one_based_inclusive_steps(tiny_data: Path, tmp_path: Path) -> None:
    assert tiny_config(tiny_data, tmp_path, train={"profile_steps": "2-10"}).train.profile_range() == (2, 10)
    assert tiny_config(tiny_data, tmp_path, train={"profile_steps": "4-4"}).train.profile_range() == (4, 4)
    assert tiny_config(tiny_data, tmp_path).train.profile_range() is None


def test_a_memory_snapshot_on_the_cpu_is_refused_before_anything_is_written(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"memory_snapshot": True, "device": "cpu"})
    with pytest.raises(ValueError, match=r"train.memory_snapshot=true records CUDA's allocator, but this run's "
                                         r"device is cpu"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def _x(name: str, start: float, end: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": start, "dur": end - start, "cat": cat, "pid": 7, "tid": tid}


def test_the_step_split_gives_each_instant_to_one_part() -> None:
    """One 100 us step, every stretch of it placed by hand by the rules of profile_split's docstring."""
    events = [
        _x("train_step/5", 0, 100, "user_annotation"),
        _x("aten::mm", 10, 30),  # compute 20
        _x("comm/tp/all_reduce", 30, 50, "user_annotation"),  # an AxisGroup collective: tp 20, its op inside
        _x("c10d::allreduce_", 31, 33),
        _x("exchange/pp/pipeline send/recv", 50, 90, "user_annotation"),  # 50-55 in no event: host
        _x("gloo:recv", 55, 80, "user_annotation"),  # the stage waits: bubble 5 + 15
        _x("aten::add", 60, 65),  # compute while the receive is posted: 5
        _x("c10d::allreduce_", 85, 86),  # a library's collective on pp: 1
        # on the backend's thread, begun in the pp range: pp 4, and its 5 us tail after the range pp too (a trace of
        # DDP's buckets under load had such tails counted as no axis)
        _x("gloo:all_reduce", 86, 95, "user_annotation", tid=2),
        _x("gloo:all_reduce", 96, 99, "user_annotation", tid=2),  # begun outside every range: 3 of no axis
    ]
    split = split_trace({"traceEvents": events})
    assert split["steps"] == [5]
    assert split["compute"] == pytest.approx(25e-6)
    assert split["bubble"] == pytest.approx(20e-6)
    assert split["comm"] == pytest.approx({"tp": 20e-6, "pp": 10e-6, "unattributed": 3e-6})
    assert split["host"] == pytest.approx(22e-6)  # 0-10, 50-55, 80-85, 95-96, 99-100
    assert split["step"] == pytest.approx(100e-6)
    assert split["labels"] == {"comm/tp/all_reduce": 1, "exchange/pp/pipeline send/recv": 1}


def test_a_cuda_trace_is_split_on_the_device_by_where_each_nccl_kernel_was_launched() -> None:
    """Kernels on a stream: compute while a non-NCCL kernel runs; an NCCL kernel exposed takes the part its launch
    (same correlation id) was issued in; the device idle is host work."""
    def launch(start: float, corr: int) -> dict:
        return {**_x("cudaLaunchKernel", start, start + 1, "cuda_runtime"), "args": {"correlation": corr}}

    def kernel(name: str, start: float, end: float, corr: int) -> dict:
        return {**_x(name, start, end, "kernel", tid=9), "args": {"correlation": corr}}

    events = [
        _x("train_step/2", 0, 100, "user_annotation"),
        _x("comm/tp/all_reduce", 4, 8, "user_annotation"), launch(5, 1),  # issued in a tp collective
        _x("exchange/pp/pipeline send/recv", 10, 30, "user_annotation"),
        _x("nccl:recv 0<-1", 11, 13, "user_annotation"), launch(12, 2),  # the pipeline's receive
        _x("c10d::send", 20, 22), launch(21, 3),  # its send
        launch(40, 4), launch(41, 5), launch(42, 6),
        kernel("ampere_sgemm_128x64_tn", 10, 30, 4),  # compute 20
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 25, 40, 1),  # tp: 30-40 exposed
        kernel("ncclDevKernel_SendRecv", 40, 55, 2),  # bubble 15
        kernel("ncclDevKernel_SendRecv", 50, 60, 3),  # pp: 55-60 after the receive ends
        kernel("ncclDevKernel_AllGather_RING_LL", 70, 75, 99),  # no launch in the trace: no axis
        {**_x("Memcpy HtoD (Pageable -> Device)", 80, 90, "gpu_memcpy", tid=9), "args": {}},  # compute 10
    ]
    split = split_trace({"traceEvents": events})
    assert split["timeline"] == "device"
    assert split["compute"] == pytest.approx(30e-6)
    assert split["bubble"] == pytest.approx(15e-6)
    assert split["comm"] == pytest.approx({"tp": 10e-6, "pp": 5e-6, "unattributed": 5e-6})
    assert split["host"] == pytest.approx(35e-6)  # 0-10, 60-70, 75-80, 90-100
