#!/usr/bin/env bash
# Creates .venv/ in the checkout and installs longctx editable with its dev extras.
# CPU machines take the local CPU torch wheel (an unpinned `torch` would pull a multi-GB
# CUDA build); GPU machines take a CUDA torch and, with the `gpu` extra, flash-attn.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CPU_TORCH=${CPU_TORCH:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: CUDA GPU found, installing CUDA torch and the gpu extra"
  "${pip[@]}" install -q torch
  "${pip[@]}" install -q -e ".[dev,slurm,eval,llama3]"
  "${pip[@]}" install -q --no-build-isolation -e ".[gpu]" \
    || echo "setup: flash-attn did not build; the flex and sdpa backends remain" >&2
else
  echo "setup: no GPU, installing the CPU torch wheel ($CPU_TORCH)"
  "${pip[@]}" install -q "$CPU_TORCH"
  "${pip[@]}" install -q -e ".[dev,slurm,eval,llama3]"
fi
# exports are tested against transformers 4.x too, in a venv of its own (tests/e2e/test_export_tf4.py
# skips, naming this step, where it could not be made)
[ -x .venv-tf4/bin/python ] || bash scripts/setup_tf4_venv.sh \
  || echo "setup: no transformers 4.x venv; the 4.x export test will skip" >&2
.venv/bin/python -c "import torch, longctx; print('setup: torch', torch.__version__, 'longctx ok')"
