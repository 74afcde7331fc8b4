"""The commands the README's benchmark lines show, run as a user would type them (the rules, the parsing and the
workspace are tests/test_doc_commands.py's): a module of their own, so that ``make test``'s pytest-xdist workers run
them beside the README's other commands, in a workspace of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_doc_commands import DocCommand, in_group, run_documented, workspace_fixture

workspace = workspace_fixture("benchmarks")


@pytest.mark.slow
@in_group("benchmarks")
def test_documented_command_runs(command: DocCommand, workspace: tuple[Path, dict[str, str]]) -> None:
    run_documented(command, *workspace)
