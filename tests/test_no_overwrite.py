"""No silent overwrite, the umask honoured, one JSON document on stdout (issue 28, faults 7, 9 and 10)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dist_trainer.checkpoint.publish import atomic_save
from dist_trainer.cli import main
from dist_trainer.files import atomic_write_text, refuse_nonempty, write_safetensors
from tests.test_cli_errors import one_line_error

PLAN = ["plan", "--model", "gpt2", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "128", "--global-batch", "8",
        "--top", "1"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_plan_out_refuses_a_folder_holding_the_users_files(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    out.mkdir()
    (out / "run.yaml").write_text("# mine, edited by hand\n")
    (out / "launch.sh").write_text("echo mine\n")
    assert one_line_error(capsys, [*PLAN, "--out", str(out)]) == (
        f"--out={out} is not empty (it holds launch.sh, run.yaml): pass --force to write over what is there, or give "
        "a new or empty folder")
    assert (out / "run.yaml").read_text() == "# mine, edited by hand\n"
    assert (out / "launch.sh").read_text() == "echo mine\n"
    assert main([*PLAN, "--out", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    wrote = next(line for line in printed.splitlines() if line.startswith("wrote "))
    # the run config and launch script, between them a DeepSpeed config where the plan picked a ZeRO stage
    assert wrote.startswith(f"wrote {out / 'run.yaml'}, ") and wrote.endswith(f", {out / 'launch.sh'}"), printed
    assert "# mine" not in (out / "run.yaml").read_text()
    with pytest.raises(ValueError, match="is not empty"):  # the helper `export` is to use (the lead's rewrite)
        refuse_nonempty(out, force=False)
    refuse_nonempty(out, force=True)
    refuse_nonempty(tmp_path / "new", force=False)


def test_plan_json_out_is_one_json_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --json --out DIR | jq` parses: the files written and the pre-launch check go to stderr."""
    capsys.readouterr()
    assert main([*PLAN, "--json", "--out", str(tmp_path / "plan")]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # the whole of stdout, nothing after it
    assert document["layouts"] and "wrote " in captured.err and "dist-trainer check --config" in captured.err


def test_written_files_honour_the_umask(tmp_path: Path, umask_027: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Under umask 027: 0640 for every file (safetensors alone wrote 0600 whatever the umask), 0750 for launch.sh
    (a chmod 0755 gave everyone what the umask withheld)."""
    weights = tmp_path / "model.safetensors"
    write_safetensors({"w": torch.ones(2, 2)}, weights, metadata={"format": "pt"})
    atomic_write_text(tmp_path / "config.json", "{}")
    atomic_save({"x": torch.zeros(1)}, tmp_path / "state.pt")
    assert {p.name: oct(_mode(p)) for p in tmp_path.iterdir()} == {
        "model.safetensors": "0o640", "config.json": "0o640", "state.pt": "0o640"}
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(weights))["w"], torch.ones(2, 2))
    assert main([*PLAN, "--out", str(tmp_path / "plan")]) == 0
    assert oct(_mode(tmp_path / "plan" / "launch.sh")) == "0o750"
    assert oct(_mode(tmp_path / "plan" / "run.yaml")) == "0o640"
