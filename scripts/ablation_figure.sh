#!/usr/bin/env bash
# The position ablation of docs/results.md: the 2x2 grid (reset_position_ids x document_mask) on
# CPU, then studies.analysis over it (in docs/results/position_ablation/: ablation.png,
# ablation_held_out.png and the summary ablation.json: held-out loss per arm with bootstrap CIs,
# paired verdicts).
#
#   scripts/ablation_figure.sh [SWEEP_DIR] [extra train.py overrides ...]
#
# Sizes come from the environment: SEQ_LEN (default 4096), STEPS per arm (300), ROWS per step (1),
# VAL_EVERY (100 steps), SEEDS (0; e.g. 0,1 adds seed-to-seed spread). fp32: on a CPU without
# native bf16 matmuls (no AVX512-BF16/AMX) bf16 autocast is far slower, not faster.
# Every arm is also scored on the same held-out documents (the whole validation split), each
# alone (callbacks=ablation, set by the experiment). Runs go to SWEEP_DIR (default
# outputs/ablation_result), logged by W&B (offline without a key).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
SWEEP="${1:-outputs/ablation_result}"
shift || true
SEQ_LEN="${SEQ_LEN:-4096}" STEPS="${STEPS:-300}" ROWS="${ROWS:-1}" VAL_EVERY="${VAL_EVERY:-100}"
SEEDS="${SEEDS:-0}"

"$PY" train.py -m experiment=position_ablation "hydra.sweep.dir=$SWEEP" \
  "data.seq_len=$SEQ_LEN" "data.micro_batch_size=$ROWS" \
  "trainer.max_steps=$STEPS" "trainer.val_check_interval=$VAL_EVERY" "seed=$SEEDS" "$@"

"$PY" -m studies.analysis "$SWEEP" --out docs/results/position_ablation/ablation.png --title \
  "position ablation: tiny, L=$SEQ_LEN, $ROWS row(s) x $STEPS steps per arm, seeds $SEEDS (CPU, fp32)"
