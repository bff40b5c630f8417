#!/usr/bin/env bash
# The positive control of the effective-length suite (issue #34): tiny_long trained with the
# long-range mix (experiment=ruler_control) and, on the same budget, without it
# (experiment=ruler_control_nomix); both scored on the same suite instances (one instance seed)
# at 1/4, 1/2, 1 and 2 x the training length; the summary JSON (which arm is the control, the
# seeds, the instances' seed, the effective length per arm) and the length x depth heat maps are
# written by python -m studies.ruler_report.
#
#   scripts/ruler_control.sh [RUNS_ROOT] [extra overrides for both arms ...]
#
# From the environment: SEQ (training length, default 256), SEED (training seed, 0), MIX_SEED
# (the synthesized mix's seed, 1000), INSTANCE_SEED (the suite's, 0), SAMPLES (per task, length
# and depth, 10), LENGTHS (default SEQ/2 (>= 192), SEQ, 2 SEQ), MIX_DOCUMENTS (20000 per task;
# the repeat folder 3x), OUT (default docs/results/ruler_control/ruler_control.json; the figure
# goes beside it as .png),
# PARALLEL (1: the two arms at once, one thread each, their logs in RUNS_ROOT/<arm>.log; 0: in turn).
# The control arm synthesizes its two mixes (experiment=ruler_control's ruler_mix and ruler_repeat)
# into the cache on first use; a later run with the same settings reuses them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/ruler_control}"
shift || true
SEQ="${SEQ:-256}" SEED="${SEED:-0}" MIX_SEED="${MIX_SEED:-1000}" INSTANCE_SEED="${INSTANCE_SEED:-0}"
SAMPLES="${SAMPLES:-10}" PARALLEL="${PARALLEL:-1}" OUT="${OUT:-docs/results/ruler_control/ruler_control.json}" DOCS="${MIX_DOCUMENTS:-20000}"
TASKS="lc_passkey,lc_niah_single,lc_copy"
# half the training length (at least the needle tasks' minimum), the training length, twice it
LENGTHS="${LENGTHS:-$(( SEQ / 2 < 192 ? 192 : SEQ / 2 )) $SEQ $(( 2 * SEQ ))}"
CACHE="${LONGCTX_CACHE:-$PWD/data_cache}"
source scripts/checks.sh
for var in SEQ SAMPLES; do positive_int "$var" "${!var}"; done
one_of PARALLEL "$PARALLEL" 0 1
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
if [ -e "$ROOT/outputs/train" ]; then
  echo "ruler_control: $ROOT/outputs/train exists (an earlier run); pass another RUNS_ROOT" >&2
  exit 2
fi
start=$SECONDS
# one arm: train, then score on the suite; its wall time goes to $ROOT/<arm>.wall_s
run_arm() {
  local arm=$1 t=$SECONDS
  shift
  "$PY" train.py "experiment=$arm" "run_name=$arm" "paths.root_dir=$ROOT" logger=csv \
    "paths.cache_dir=$CACHE" "ruler_mix.seed=$MIX_SEED" "ruler_mix.documents=$DOCS" \
    "ruler_repeat.seed=$(( MIX_SEED + 1 ))" "ruler_repeat.documents=$(( 3 * DOCS ))" "seed=$SEED" \
    "data.seq_len=$SEQ" "$@"
  "$PY" -m longctx.eval "$ROOT/outputs/train/$arm/checkpoints/last.ckpt" --suite ruler \
    --tasks "$TASKS" --lengths $LENGTHS --depths 0 0.25 0.5 0.75 1 --samples "$SAMPLES" \
    --seed "$INSTANCE_SEED" --cache-dir "$CACHE"
  echo $(( SECONDS - t )) > "$ROOT/$arm.wall_s"
}
mkdir -p "$ROOT"
if [ "$PARALLEL" = 1 ]; then
  # the two arms side by side, a core (one thread) each: the same wall as one arm on a 2-core
  # machine, where two threads of one tiny model gain little
  OMP_NUM_THREADS=1 run_arm ruler_control "$@" > "$ROOT/ruler_control.log" 2>&1 & control=$!
  OMP_NUM_THREADS=1 run_arm ruler_control_nomix "$@" > "$ROOT/ruler_control_nomix.log" 2>&1 & nomix=$!
  status=0
  wait "$control" || { status=$?; echo "ruler_control failed: $ROOT/ruler_control.log" >&2; }
  wait "$nomix" || { status=$?; echo "ruler_control_nomix failed: $ROOT/ruler_control_nomix.log" >&2; }
  [ "$status" = 0 ] || exit "$status"
else
  run_arm ruler_control "$@"
  run_arm ruler_control_nomix "$@"
fi
seconds=$(( SECONDS - start ))
extra=$(printf '{"control_arm": "ruler_control", "negative_arm": "ruler_control_nomix", "train_seed": %s, "mix_seed": %s, "mix_documents": [%s, %s], "training_length": %s, "wall_s": %s, "arm_wall_s": {"ruler_control": %s, "ruler_control_nomix": %s}}' \
  "$SEED" "$MIX_SEED" "$DOCS" "$(( 3 * DOCS ))" "$SEQ" "$seconds" \
  "$(cat "$ROOT/ruler_control.wall_s")" "$(cat "$ROOT/ruler_control_nomix.wall_s")")
"$PY" -m studies.ruler_report "$ROOT/outputs/train" --arm-by group --control ruler_control \
  --json "$OUT" --extra "$extra" \
  --note "positive control: tiny_long at $SEQ tokens with the long-range mix (ruler_control) and without it (ruler_control_nomix), train seed $SEED, mix seed $MIX_SEED, instance seed $INSTANCE_SEED; ${seconds} s wall"
echo "ruler_control: ${seconds} s in all; results in $ROOT"
