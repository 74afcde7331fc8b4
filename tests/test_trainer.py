"""The trainer loop: DDP parity with one process, exact resume, safe checkpoints, eval, generation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_trainer.checkpoint import publish as ckpt
from dist_trainer.checkpoint.plain import load_plain_model
from dist_trainer.testing import run_distributed
from dist_trainer.train.generate import generate_text
from dist_trainer.train.trainer import Trainer
from tests.helpers import assert_same_curves, curves, tiny_config


def _train_curves(rank: int, world_size: int, data: Path, out: Path, sections: dict) -> dict:
    return curves(Trainer(tiny_config(data, out, **sections)).train())


def _both_curves(rank: int, world_size: int, data: Path, root: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """Several runs one after the other in one spawn, each in its own folder."""
    return {name: _train_curves(rank, world_size, data, root / name, sections) for name, sections in cases.items()}


def test_ddp_two_ranks_equals_one_process(tiny_data: Path, tmp_path: Path) -> None:
    """Same global batch of 8: one process (2 micro-batches of 4) vs 2 DDP ranks, with and without
    accumulation on each rank. fp32, 10 steps, evaluation every 5 and checkpoints on: training and eval
    losses within relative 1e-5."""
    single = _train_curves(0, 1, tiny_data, tmp_path / "single", {})
    both = run_distributed(_both_curves, 2, (tiny_data, tmp_path, {"ddp": {},
                                                                  "ddp_accum": {"parallel": {"micro_batch_size": 2}}}))
    ddp, ddp_accum = [r["ddp"] for r in both], [r["ddp_accum"] for r in both]
    assert len(single["losses"]) == 10 and single["losses"][9] < single["losses"][0]
    assert sorted(single["eval"]) == [0, 5, 10] and single["eval"][10] < single["eval"][0]
    assert ddp[0] == ddp[1]  # every rank reports the same (dp-averaged) losses
    assert_same_curves(ddp[0], single, what="ddp")
    assert_same_curves(ddp_accum[0], single, what="ddp+accumulation")


def test_resume_is_bitwise_exact(tiny_data: Path, tmp_path: Path) -> None:
    """Dropout on, so the saved RNG states matter: steps 4..6 after a resume at 3 equal the
    uninterrupted run's bit for bit."""
    sections = {"model": {"dropout": 0.1}, "train": {"max_steps": 6, "save_every": 3}}
    full = Trainer(tiny_config(tiny_data, tmp_path / "full", **sections)).train().losses
    first = Trainer(tiny_config(tiny_data, tmp_path / "resumed", **{**sections, "train": {"max_steps": 3}}))
    first.train()
    again = Trainer(tiny_config(tiny_data, tmp_path / "resumed",
                                **{**sections, "train": {"max_steps": 6, "save_every": 3, "resume": True}}))
    assert again.step == 3
    resumed = again.train().losses
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step] == full[step], (step, resumed[step], full[step])


def test_checkpoints_keep_last_k_and_hold_everything(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, train={"max_steps": 4, "save_every": 1, "keep_checkpoints": 2})
    Trainer(cfg).train()
    kept = ckpt.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in kept] == ["step_00000003", "step_00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    meta = ckpt.read_meta(kept[-1])
    assert meta["step"] == 4 and meta["data"]["consumed_samples"] == 32
    assert meta["config"]["model"]["d_model"] == 32
    optim = ckpt.load_file(kept[-1] / "optim_tp00_pp00.pt")
    assert set(optim["state"]["layers.0.attn.q_proj.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    rng = ckpt.load_file(kept[-1] / "rng_rank00000.pt")
    assert {"torch", "python"} <= set(rng)


def test_crash_during_save_leaves_previous_checkpoint_loadable(tiny_data: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(tiny_data, tmp_path, train={"max_steps": 2, "save_every": 1})
    trainer = Trainer(cfg)
    trainer.train()
    good = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    assert good is not None and good.name == "step_00000002"
    real_save = ckpt.atomic_save

    def dying_save(obj: object, path: Path) -> None:
        if path.name.startswith("optim"):
            path.with_suffix(".pt.part").write_bytes(b"half a file")
            raise KeyboardInterrupt("killed while writing")
        real_save(obj, path)

    monkeypatch.setattr(ckpt, "atomic_save", dying_save)
    trainer.step = 3
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    assert (tmp_path / "checkpoints" / "step_00000003.tmp").is_dir()  # the wreck stays aside
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints") == good
    monkeypatch.setattr(ckpt, "atomic_save", real_save)
    resumed = Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 3, "resume": True}))
    assert resumed.step == 2


def test_resume_refuses_a_different_model(tiny_data: Path, tmp_path: Path) -> None:
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 1})).train()
    with pytest.raises(ValueError, match=r"'d_model': \(32, 64\)"):
        Trainer(tiny_config(tiny_data, tmp_path, model={"d_model": 64}, train={"resume": True}))


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another preparation with tiny_data's vocabulary: other documents, so other shards and samples."""
    import sysconfig

    from dist_trainer.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("other") / "data"
    prepare([stdlib / "logging", stdlib / "csv.py"], out, vocab_size=512, val_fraction=0.1, max_bytes=200_000)
    return out


def test_resume_refuses_changed_data_naming_old_and_new(tiny_data: Path, tmp_path: Path, other_data: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """data.seq_len, other shards under another data.path, or other shards prepared at the same path change the
    samples of every step: refused with the old and new values, unless train.allow_data_change=true. The same
    shards moved elsewhere resume."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    run = tmp_path / "run"
    Trainer(tiny_config(data, run, train={"max_steps": 2})).train()

    def resume(data_path: Path, seq_len: int = 32, **train: bool) -> Trainer:
        cfg = tiny_config(data_path, run, train={"max_steps": 3, "resume": True, **train})
        cfg.data.seq_len = seq_len  # tiny_config's first argument is the data path, not the data section
        return Trainer(cfg)

    with pytest.raises(ValueError, match=r"the checkpoint's data settings changed \(saved -> now\): data.seq_len "
                                         r"32 -> 16\. The resumed run would read other samples .* pass "
                                         r"--train.allow_data_change=true to resume anyway"):
        resume(data, seq_len=16)
    with pytest.raises(ValueError, match=rf"data.path {data} -> {other_data} \(other shards\)"):
        resume(other_data)
    moved = tmp_path / "moved"
    data.rename(moved)
    assert resume(moved).step == 2  # the same shards under another path: the same samples
    shutil.copytree(other_data, data)  # the old path now holds another preparation
    with pytest.raises(ValueError, match=rf"the shards in data.path={data} \(prepared again since the checkpoint\)"):
        resume(data)
    capsys.readouterr()
    allowed = resume(data, allow_data_change=True)
    assert allowed.step == 2
    assert "train.allow_data_change=true: resuming although the checkpoint's data settings changed" in \
        capsys.readouterr().out
    allowed.train()


def test_metrics_hold_every_step_once_after_a_resume(tiny_data: Path, tmp_path: Path) -> None:
    """A run that went on past its last checkpoint (steps 4 and 5, then died: here its step-5 checkpoint is
    removed, and a line cut by the kill is appended) resumes at 3: records 4 and 5 of the lost run are moved
    aside, so metrics.jsonl holds steps 1..6 once each."""
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 5, "save_every": 3})).train()
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000005")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 4.')
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 6, "save_every": 3, "resume": True})).train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    moved = (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [4, 5] and moved[2] == '{"step": 6, "loss": 4.'


def test_corrupt_checkpoint_file_is_named(tiny_data: Path, tmp_path: Path) -> None:
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 1})).train()
    step = ckpt.latest_checkpoint(tmp_path / "checkpoints")
    (step / "model_tp00_pp00.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="model_tp00_pp00.pt cannot be read"):
        Trainer(tiny_config(tiny_data, tmp_path, train={"resume": True}))


def test_corrupt_data_is_refused_before_any_process_group(tiny_data: Path, tmp_path: Path) -> None:
    """A flipped byte in a shard stops the run when the data is opened: no process group, nothing written."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = data / "train_000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"shard {shard} has sha256 .*the data is corrupted; re-run "
                                         rf"`dist-trainer prepare` with --out {data} --force"):
        Trainer(tiny_config(data, tmp_path / "run"))
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_eval_loss_and_metrics_file(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, train={"max_steps": 4, "eval_every": 2, "eval_batches": 2})
    result = Trainer(cfg).train()
    assert sorted(result.eval_losses) == [0, 2, 4]
    assert result.eval_losses[4] < result.eval_losses[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_bytes", "step_time_s"):
        assert all(isinstance(r[key], (int, float)) and r[key] >= 0 for r in records), key
    assert "eval_loss" in records[1] and "eval_loss" not in records[0]
    assert records[0]["lr"] == pytest.approx(cfg.optim.lr / 2)  # warmup step 1 of 2


def test_bf16_autocast_trains_close_to_fp32(tiny_data: Path, tmp_path: Path) -> None:
    fp32 = Trainer(tiny_config(tiny_data, tmp_path / "a", train={"max_steps": 3})).train().losses
    bf16 = Trainer(tiny_config(tiny_data, tmp_path / "b", train={"max_steps": 3, "precision": "bf16"})).train().losses
    assert all(abs(bf16[s] - fp32[s]) / fp32[s] < 0.02 for s in fp32)


def test_encoder_mlm_trains(tiny_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config(tiny_data, tmp_path, model={"causal": False, "norm_placement": "post", "n_token_types": 2,
                                                  "pooler": True}, train={"max_steps": 8})
    losses = Trainer(cfg).train().losses
    assert losses[7] < losses[0]


def test_generate_from_checkpoint(tiny_data: Path, tmp_path: Path) -> None:
    Trainer(tiny_config(tiny_data, tmp_path, train={"max_steps": 2})).train()
    model, cfg = load_plain_model(tmp_path)
    saved = ckpt.load_file(ckpt.latest_checkpoint(tmp_path / "checkpoints") / "model_tp00_pp00.pt")
    assert torch.equal(model.tok_emb.weight, saved["tok_emb.weight"])
    text = generate_text(tmp_path, "def ", max_new_tokens=10, seed=1)
    assert text.startswith("def ") and len(text) > len("def ")
    assert text == generate_text(tmp_path, "def ", max_new_tokens=10, seed=1)  # seeded sampling


def test_export_safetensors_round_trip(tiny_data: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from dist_trainer.cli import main

    Trainer(tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 1})).train()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export"),
                 "--format", "native"]) == 0
    tensors = load_file(str(tmp_path / "export" / "model.safetensors"))
    saved = ckpt.load_file(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints") / "model_tp00_pp00.pt")
    assert set(tensors) == set(saved)
    assert all(torch.equal(tensors[k], saved[k]) for k in saved)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["d_model"] == 32


def test_wandb_offline_run_is_written_under_the_run_folder(tiny_data: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb defaults to offline: the run lands in out_dir/wandb and nothing leaves the machine."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the suite disables wandb; this test wants the default
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"max_steps": 2}, wandb={"mode": "offline"})
    Trainer(cfg).train()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs
