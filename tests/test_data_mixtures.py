"""Weighted mixtures of prepared folders (``data.sources``, data/mixture.py; issue 35, item 3).

The shares follow the weights, a step's global batch depends only on (weights, seed, step) and is the same at any
DP degree, a run resumed at another world size continues with the uninterrupted run's next batches (losses, the
per-source eval losses and tokens seen), and bad sources are refused before anything is written.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from dist_trainer.config_load import config_from_dict, load_config
from dist_trainer.data.mixture import MixtureSampler, source_counts
from dist_trainer.data.objective import make_batch, open_split
from dist_trainer.facts.sources import parse_sources
from dist_trainer.testing import run_distributed
from dist_trainer.train.check import check_run
from dist_trainer.train.evaluate import evaluate
from dist_trainer.train.generate import prompt_tokenizer
from dist_trainer.train.resume_checks import check_resumable, data_order
from dist_trainer.train.summary import print_summary
from dist_trainer.train.trainer import Trainer, TrainResult
from tests.helpers import TINY_VOCAB, assert_same_curves, curves, tiny_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two folders tokenized with one BPE ("web" trains it, "code" reuses it) and one with a BPE of its own."""
    from dist_trainer.data.prepare import prepare

    root = tmp_path_factory.mktemp("mix")
    prepare([STDLIB / "json", STDLIB / "argparse.py"], root / "web", vocab_size=TINY_VOCAB, val_fraction=0.1,
            max_bytes=150_000, seed=0)
    prepare([STDLIB / "email", STDLIB / "textwrap.py"], root / "code", tokenizer=root / "web", val_fraction=0.1,
            max_bytes=150_000, seed=0)
    prepare([STDLIB / "email"], root / "other", vocab_size=TINY_VOCAB, val_fraction=0.1, max_bytes=60_000, seed=0)
    return {name: root / name for name in ("web", "code", "other")}


def _mix(paths: dict[str, Path], web: float = 0.7, code: float = 0.3) -> list[dict]:
    return [{"path": str(paths["web"]), "weight": web}, {"path": str(paths["code"]), "weight": code}]


# ------------------------------------------------------------------ the sampler (no data read)


@pytest.mark.parametrize("weights", [(0.7, 0.2, 0.1), (3, 1, 1), (0.5, 0.5, 0.005)])
def test_shares_follow_the_weights(weights: tuple[float, ...]) -> None:
    sampler = MixtureSampler([97, 300, 41], list(weights), 16, 4, 0, 1, seed=5)
    offsets = sampler.offsets
    drawn = [sampler.source_of(i) for step in range(625) for i in sampler.global_batch(step)]  # 10,000 samples
    assert len(drawn) == 10_000 and all(0 <= i < offsets[-1] for i in drawn)
    shares = Counter(drawn)
    for s, w in enumerate(weights):
        assert abs(shares[s] / len(drawn) - w / sum(weights)) < 0.01, (s, shares, weights)
    assert sampler.samples_seen(625) == [shares[s] for s in range(len(weights))]  # the metric counts what was drawn


def test_each_source_is_read_in_passes_of_fresh_permutations() -> None:
    sampler = MixtureSampler([10, 7], [1, 1], 4, 2, 0, 1, seed=0)
    small = [i - 10 for step in range(14) for i in sampler.global_batch(step) if i >= 10]  # 28 samples, 4 passes
    passes = [small[k:k + 7] for k in range(0, 28, 7)]
    assert all(sorted(p) == list(range(7)) for p in passes)  # every sample once per pass, none dropped
    assert len({tuple(p) for p in passes}) > 1


def test_counts_are_monotone_and_exact() -> None:
    weights = [Fraction(w) for w in (0.6, 0.25, 0.15)]
    previous = [0, 0, 0]
    for n in range(1, 500):  # one slot at a time: exactly one source gains it, no source loses one
        counts = source_counts(weights, n)
        assert sum(counts) == n and sorted(c - p for c, p in zip(counts, previous)) == [0, 0, 1], (n, counts)
        assert all(abs(c - float(w) * n) < 1 for c, w in zip(counts, weights))
        previous = counts


def test_deterministic_per_seed_and_step() -> None:
    def batches(seed: int, steps: list[int]) -> list[list[int]]:
        sampler = MixtureSampler([50, 80], [0.3, 0.7], 8, 2, 0, 1, seed=seed)
        return [sampler.global_batch(s) for s in steps]

    steps = [0, 1, 2, 9, 40]
    assert batches(3, steps) == batches(3, steps)
    assert batches(3, steps[::-1]) == batches(3, steps)[::-1]  # a fresh sampler at any step: nothing carried over
    assert batches(3, steps) != batches(4, steps)


@pytest.mark.parametrize("micro", [1, 2])
def test_global_batch_is_the_same_at_world_sizes_1_and_2(micro: int) -> None:
    for step in (0, 3, 17):
        whole = MixtureSampler([50, 80], [0.3, 0.7], 8, micro, 0, 1, seed=2)
        reference = [i for m in whole.micro_batches(step) for i in m]
        ranks = [MixtureSampler([50, 80], [0.3, 0.7], 8, micro, r, 2, seed=2) for r in range(2)]
        assert [i for s in ranks for m in s.micro_batches(step) for i in m] == reference == whole.global_batch(step)


# ------------------------------------------------------------------ a real run, resumed at another world size


def _resume(rank: int, world_size: int, data: list[dict], out: Path) -> dict:
    trainer = Trainer(_config(data, out, resume=True), log=rank == 0)
    assert trainer.step == 2, trainer.step
    result = trainer.train()
    return {**curves(result), "by_source": result.eval_by_source}


def _config(data: list[dict], out: Path, resume: bool = False):  # noqa: ANN202 - a Config
    return tiny_config(Path("unused"), out, data={"path": "data/default", "sources": data},
                       train={"max_steps": 4, "save_every": 2, "eval_every": 2, "resume": resume})


def _records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r}


def test_resume_at_another_world_size_continues_the_run(sources: dict[str, Path], tmp_path: Path) -> None:
    data = _mix(sources)
    whole = Trainer(_config(data, tmp_path / "whole")).train()  # 1 process, checkpoints at steps 2 and 4
    assert set(whole.eval_by_source[4]) == {"web", "code"}
    assert whole.eval_by_source[4]["web"] != whole.eval_by_source[4]["code"]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_00000002",
                    resumed_dir / "checkpoints" / "step_00000002")
    resumed = run_distributed(_resume, 2, args=(data, resumed_dir))[0]
    ref = curves(whole)
    ref = {"losses": {s: v for s, v in ref["losses"].items() if s >= 2},
           "eval": {s: v for s, v in ref["eval"].items() if s > 2}}
    assert_same_curves({"losses": resumed["losses"], "eval": resumed["eval"]}, ref, what="1 process -> 2 ranks")
    for name, loss in whole.eval_by_source[4].items():
        assert resumed["by_source"][4][name] == pytest.approx(loss, rel=1e-5), name
    got, want = _records(resumed_dir)[4], _records(tmp_path / "whole")[4]
    assert {k: v for k, v in got.items() if k.startswith("tokens/")} == \
        {k: v for k, v in want.items() if k.startswith("tokens/")} != {}
    assert got["eval_loss/code"] == pytest.approx(want["eval_loss/code"], rel=1e-5)
    # `dist-trainer eval` of the run's checkpoint evaluates each source as the run did
    report = json.loads(evaluate([str(resumed_dir)], {}, as_json=True))
    assert report["settings"]["sources"] and report["rows"][0]["by_source"] == pytest.approx(
        whole.eval_by_source[4], rel=1e-5)
    assert report["rows"][0]["eval_loss"] == pytest.approx(whole.eval_losses[4], rel=1e-5)
    assert "web" in evaluate([str(resumed_dir)], {})  # the text report has a column per source


def test_check_reports_each_source(sources: dict[str, Path], tmp_path: Path) -> None:
    """`dist-trainer check` checks the mixture's folders, not data.path's default."""
    lines = check_run(_config(_mix(sources), tmp_path / "run"), 2, device_type="cpu")
    assert any(line.startswith("data source web (") and "70.0% of the samples" in line for line in lines), lines
    assert any(line.startswith("data source code (") for line in lines), lines
    with pytest.raises(ValueError, match=r"data\.sources\[1\] .*does not exist"):
        check_run(_config(_mix({**sources, "code": tmp_path / "gone"}), tmp_path / "run"), 2, device_type="cpu")


def test_summary_and_generate_know_the_sources(sources: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(_mix(sources), tmp_path)
    result = TrainResult(losses={0: 3.0}, eval_losses={0: 2.0, 4: 1.5},
                         eval_by_source={0: {"web": 2.1, "code": 1.9}, 4: {"web": 1.25, "code": 1.75}})
    print_summary(cfg, result)
    out = capsys.readouterr().out
    assert "web" in out and "2.1000 (step 0) -> 1.2500 (step 4)" in out and "1.9000 (step 0) -> 1.7500" in out
    # a text prompt of a mixture run is encoded with the sources' tokenizer (the first folder's)
    assert Path(prompt_tokenizer(tmp_path, cfg, None).source).parent == sources["web"]


def test_span_corruption_reads_a_mixture(span_data: Path, tmp_path: Path) -> None:
    """The batch builders read a mixture as one folder: T5's span corruption draws from both sources."""
    from dist_trainer.data.prepare import prepare

    prepare([STDLIB / "textwrap.py"], tmp_path / "more", tokenizer=span_data, val_fraction=0.0, seed=0)
    cfg = tiny_config(Path("unused"), tmp_path / "run", model={"preset": "tiny-t5", "vocab_size": TINY_VOCAB},
                      data={"path": "data/default", "objective": "span_corruption",
                            "sources": [{"path": str(span_data)}, {"path": str(tmp_path / "more")}]})
    data = open_split(cfg, "train")
    sampler = MixtureSampler([len(p) for p in data.parts], [1, 1], 8, 8, 0, 1, seed=0)
    indices = sampler.global_batch(0)
    assert {sampler.source_of(i) for i in indices} == {0, 1}
    batch = make_batch(cfg, data, indices, step=0)
    assert batch["tokens"].shape == (8, cfg.data.seq_len) and batch["targets"].shape[0] == 8


# ------------------------------------------------------------------ refusals


def _open(data: list[dict]) -> None:
    open_split(tiny_config(Path("unused"), Path("unused"), data={"path": "data/default", "sources": data}), "train")


def test_a_resume_with_other_weights_is_refused(sources: dict[str, Path], tmp_path: Path) -> None:
    saved_cfg = _config(_mix(sources), tmp_path)
    meta = {"config": saved_cfg.to_dict(), "data": data_order(saved_cfg, open_split(saved_cfg, "train"))}
    assert check_resumable(meta, saved_cfg, open_split(saved_cfg, "train")) == []
    other = _config(_mix(sources, web=0.5, code=0.5), tmp_path)
    with pytest.raises(ValueError, match=r"data settings changed.*x 0\.7.* -> .*x 0\.5"):
        check_resumable(meta, other, open_split(other, "train"))


def test_a_folder_of_another_tokenizer_is_refused_naming_both(sources: dict[str, Path]) -> None:
    data = [{"path": str(sources["web"]), "weight": 1}, {"path": str(sources["other"]), "weight": 1}]
    with pytest.raises(ValueError, match="another tokenizer") as info:
        _open(data)
    assert str(sources["web"]) in str(info.value) and str(sources["other"]) in str(info.value)


def test_a_missing_folder_is_refused_naming_the_source(sources: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=r"data\.sources\[1\] \(.*nowhere, weight 0\.3\): the folder does not exist"):
        _open(_mix({**sources, "code": missing}))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="does not exist"):
        Trainer(_config(_mix({**sources, "code": missing}), out))
    assert not out.exists()  # refused before anything is written


@pytest.mark.parametrize("weight", [0, -1, float("nan"), "heavy", True])
def test_a_bad_weight_is_refused_naming_the_source(weight: object, tmp_path: Path) -> None:
    data = [{"path": "data/web", "weight": 1}, {"path": "data/code", "weight": weight}]
    with pytest.raises(ValueError, match=r"data\.sources\[1\] \(data/code\) has weight=.* must be a number > 0"):
        config_from_dict({"data": {"sources": data}}).validate()


def test_malformed_sources_are_refused() -> None:
    for sources, message in (([], "non-empty list"), (["data/web"], r"sources\[0\]='data/web' must be a mapping"),
                             ([{"weight": 1}], r"sources\[0\] has path=None"),
                             ([{"path": "a", "wieght": 2}], r"unknown keys \['wieght'\]")):
        with pytest.raises(ValueError, match=message):
            parse_sources(sources)


def test_path_and_sources_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        load_config(None, ["data.path=data/mine", "data.sources=[{path: data/web, weight: 1}]"])
    cfg = load_config(None, ["data.sources=[{path: data/web, weight: 2}, {path: data/code}]"])  # from the CLI
    assert [(s.path, s.weight, s.name) for s in parse_sources(cfg.data.sources)] == \
        [("data/web", 2.0, "web"), ("data/code", 1.0, "code")]
