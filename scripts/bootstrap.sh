#!/usr/bin/env bash
# Creates .venv from nothing and installs Ravnest with its test tools.
# torch is installed explicitly first: the pinned CPU wheel by default, an already-installed
# torch is kept, and CUDA users choose their own with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0
# --index-url https://download.pytorch.org/whl/cu126").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  pip install -q $TORCH_SPEC
fi
# -qq: setuptools' editable installs print a banner in every mode (default: "folders with the same
# name as your package"; compat: "transitional, will be removed"), which is no news to a newcomer;
# errors still show
pip install -qq -e ".[dev]"
# the example model plug-in (docs/models.md), which the tests use as a third party would
pip install -qq --no-deps -e examples/model-plugin
echo "ravnest installed in $VENV (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
