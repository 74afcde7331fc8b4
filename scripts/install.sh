#!/usr/bin/env bash
# The one install path: `make demo`/`make test` (into .venv), CI, and both Docker images run it.
#   scripts/install.sh [VENV_DIR] [EXTRAS]      e.g. scripts/install.sh .venv dev   ("" = no extras)
# TORCH_INDEX_URL, when set, is the index torch comes from (e.g. https://download.pytorch.org/whl/cpu
# for a CPU build on a plain Linux host; the images set their own).
# Installs torch first from the pinned constraints (a CPU build where the index offers one,
# never an accidental multi-GB CUDA build), then DeepSpeed without build isolation (its
# setup.py imports torch), then this package in editable mode.
set -euo pipefail
# Physical paths (cd -P): run through a symlinked copy of the tree (tests/test_doc_commands.py's workspace), it
# still installs this checkout into the real venv, and console scripts get the real interpreter's path.
here="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
if [ -e "$venv" ]; then venv="$(cd -P "$venv" && pwd)"; fi
extras="${2-dev}"
constraints="${DIST_TRAINER_CONSTRAINTS:-$here/requirements/constraints.txt}"
python="${PYTHON:-python3}"

stamp="$venv/.dist_trainer-install"
want="$(cat "$here/pyproject.toml" "$constraints" | sha256sum | cut -c1-16)-$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/dist-trainer" ]; then
    exit 0  # up to date
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints")
"${pip[@]}" --upgrade pip setuptools wheel  # versions pinned in the constraints file
torch_pin="$(grep -E '^torch==' "$constraints" | head -n1)"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" --index-url "$TORCH_INDEX_URL" "${torch_pin:-torch}"
else
    "${pip[@]}" "${torch_pin:-torch}"
fi
# DeepSpeed ships as an sdist; its build needs the torch installed above. Ops stay JIT (DS_BUILD_OPS=0)
# except where an image builds them ahead (docker/Dockerfile sets DS_BUILD_* itself).
DS_BUILD_OPS="${DS_BUILD_OPS:-0}" "${pip[@]}" --no-build-isolation "$(grep -E '^deepspeed==' "$constraints" | head -n1)"
if [ -n "$extras" ]; then
    "${pip[@]}" -e "$here[$extras]"
else
    "${pip[@]}" -e "$here"
fi
echo "$want" > "$stamp"
