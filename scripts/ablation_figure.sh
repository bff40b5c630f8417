#!/usr/bin/env bash
# Regenerate the README figure docs/ablation.png (and docs/ablation_passkey.png): a small CPU run of
# the 2x2 position ablation (reset_position_ids x document_mask), then longctx.analysis over it.
#
#   scripts/ablation_figure.sh [RUNS_ROOT] [extra train.py overrides ...]
#
# Sizes come from the environment: SEQ_LEN (default 1024), STEPS per arm (30), ROWS per step (1),
# VAL_EVERY (15 steps; on 4 fixed rows). The passkey probe runs at the end of each arm
# (callbacks=eval). Runs go to RUNS_ROOT (default outputs/ablation_figure), logged as CSV.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/ablation_figure}"
shift || true
SEQ_LEN="${SEQ_LEN:-1024}" STEPS="${STEPS:-30}" ROWS="${ROWS:-1}" VAL_EVERY="${VAL_EVERY:-15}"
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true

"$PY" train.py experiment=position_ablation "paths.root_dir=$ROOT" \
  logger=csv callbacks=eval "paths.cache_dir=${LONGCTX_CACHE:-$PWD/data_cache}" \
  "data.seq_len=$SEQ_LEN" "data.micro_batch_size=$ROWS" data.val_rows=4 \
  "trainer.max_steps=$STEPS" "trainer.val_check_interval=$VAL_EVERY" \
  "optim.scheduler.warmup_steps=$((STEPS / 10))" "$@"

latest="$(ls -d "$ROOT"/multirun/train/* | sort | tail -1)"
"$PY" -m longctx.analysis "$latest" --out docs/ablation.png --title \
  "position ablation: tiny model, seq_len $SEQ_LEN, $ROWS row(s) x $STEPS steps per arm (CPU)"
