#!/usr/bin/env bash
# A second virtualenv with transformers 4.x, for the slow test that opens exports there
# (tests/test_export_tf4.py; it skips, naming this script, while the venv is absent):
#   bash scripts/setup_tf4_venv.sh            # creates .venv-tf4 in the repo root
#   LONGCTX_TF4_VENV=/path bash scripts/setup_tf4_venv.sh
# Only what the check script imports: torch (the CPU wheel pip finds on this machine kind),
# transformers 4.57 (the last 4.x line), safetensors, numpy. longctx itself is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${LONGCTX_TF4_VENV:-.venv-tf4}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 'transformers==4.57.*' safetensors numpy
"$VENV/bin/python" -c "import transformers; print('transformers', transformers.__version__, 'in $VENV')"
