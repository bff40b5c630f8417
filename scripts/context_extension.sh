#!/usr/bin/env bash
# The context-extension recipe (issue #22): stage 1 trains the tiny model at 256 tokens
# (experiment=context_extension_stage1), stage 2 extends it 8x to 2048 as a multirun over the RoPE
# arms {unchanged, ABF theta x50, linear, YaRN} from stage 1's weights (experiment=
# context_extension, model.init_from), then every arm is evaluated on the long held-out documents
# out to 4x its length, with the passkey probe up to that length, and the table and figure are
# written (python -m longctx.experiments.extension_report).
#
#   scripts/context_extension.sh [RUNS_ROOT] [extra overrides for both stages ...]
#
# Sizes from the environment: SEQ1 (stage 1's length, default 256; stage 2 is 8x it), STEPS1
# (default 600 steps of 8 x SEQ1), STEPS2 (150 steps of 1 x 8 SEQ1 per arm), PROBE_SAMPLES (4 per
# length and depth); FIGURE (default docs/context_extension.png; the table and numbers go beside it
# as .json).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/context_extension}"
shift || true
SEQ1="${SEQ1:-256}" STEPS1="${STEPS1:-600}" STEPS2="${STEPS2:-150}"
PROBE_SAMPLES="${PROBE_SAMPLES:-4}" SEQ2=$(( 8 * SEQ1 ))
FIGURE="${FIGURE:-docs/context_extension.png}"
CACHE="${LONGCTX_CACHE:-$PWD/data_cache}"
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
stage1="$ROOT/outputs/train/stage1"
if [ -e "$stage1" ]; then
  echo "context_extension: $stage1 exists (an earlier recipe run); pass another RUNS_ROOT" >&2
  exit 2
fi
start=$SECONDS

"$PY" train.py experiment=context_extension_stage1 run_name=stage1 "paths.root_dir=$ROOT" \
  logger=csv "paths.cache_dir=$CACHE" "data.seq_len=$SEQ1" "trainer.max_steps=$STEPS1" \
  "trainer.val_check_interval=$(( STEPS1 < 200 ? STEPS1 : 200 ))" "$@"

"$PY" train.py -m experiment=context_extension "model.init_from=$stage1" \
  "paths.root_dir=$ROOT" logger=csv "paths.cache_dir=$CACHE" "stage1_seq_len=$SEQ1" \
  "data.seq_len=$SEQ2" "trainer.max_steps=$STEPS2" \
  "trainer.val_check_interval=$(( STEPS2 < 50 ? STEPS2 : 50 ))" "$@"
sweep="$(ls -d "$ROOT"/multirun/train/* | sort | tail -1)"

for arm in "$sweep"/*rope_arm=*/; do
  "$PY" -m longctx.eval "$arm/checkpoints/last.ckpt" --cache-dir "$CACHE" --long-factor 4 \
    --probe-samples "$PROBE_SAMPLES"
done
seconds=$(( SECONDS - start ))
"$PY" -m longctx.experiments.extension_report "$sweep" --out "$FIGURE" --json "${FIGURE%.*}.json" --note \
  "tiny, stage 1: $STEPS1 x 8 x $SEQ1, stage 2: $STEPS2 x 1 x $SEQ2 per arm; ${seconds} s wall"
echo "context_extension: ${seconds} s in all; results in $sweep"
