#!/usr/bin/env bash
# The position ablation with the long-range mix (issue #34): the 2x2 grid reset_position_ids x
# document_mask (experiment=position_ablation), two training seeds, at L=4096; every run is then
# scored on the effective-length suite at 1/4, 1/2, 1 and 2 x L (the same instances for all), and
# both reports are written: held-out loss with paired bootstrap CIs (python -m studies.analysis)
# and the suite per arm with paired differences, effective lengths and heat maps
# (python -m studies.ruler_report --arm-by position; the masked pair is the control).
#
#   scripts/position_ablation.sh [RUNS_ROOT] [extra overrides ...]
#
# From the environment: MODEL (tiny), SEQ (4096), STEPS (300), VAL_EVERY (steps between
# validations, min(STEPS, 100)), ROWS (rows per step, 1), INIT_FROM
# (a trained run folder: every arm continues from its weights; default from scratch), MIX_SEED (1000), INSTANCE_SEED (0),
# SAMPLES (4 per task, length and depth), TASKS and LENGTHS of the final evaluation (four tasks at
# SEQ/4, SEQ/2, SEQ, 2 SEQ), MIX_DOCUMENTS (4000 per task), OUT
# (docs/results/position_ablation_mix/position_ablation_mix: .png/.json for the loss, _ruler.*). The positive control needed ~20 M tokens before tiny_long copied at a distance
# (docs/effective-length.md); 300 x 4096 is 1.2 M per run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/position_ablation}"
shift || true
MODEL="${MODEL:-tiny}" SEQ="${SEQ:-4096}" STEPS="${STEPS:-300}" MIX_SEED="${MIX_SEED:-1000}"
INSTANCE_SEED="${INSTANCE_SEED:-0}" SAMPLES="${SAMPLES:-4}" OUT="${OUT:-docs/results/position_ablation_mix/position_ablation_mix}"
DOCS="${MIX_DOCUMENTS:-4000}" ROWS="${ROWS:-1}" INIT_FROM="${INIT_FROM:-}"
# continued pretraining: every arm starts from INIT_FROM's weights (pass its model and RoPE too,
# e.g. MODEL=tiny_long model.rope_theta=10000), so the arms differ in what they train on last
source scripts/checks.sh
for var in SEQ STEPS ROWS SAMPLES; do positive_int "$var" "${!var}"; done
positive_int VAL_EVERY "${VAL_EVERY:-1}"
existing_path INIT_FROM "$INIT_FROM"
start_from=() from_note="from scratch"
if [ -n "$INIT_FROM" ]; then start_from=("model.init_from=$INIT_FROM"); from_note="from $INIT_FROM"; fi
TASKS="${TASKS:-lc_passkey,lc_niah_single,lc_niah_multikey,lc_copy}"
LENGTHS="${LENGTHS:-$(( SEQ / 4 )) $(( SEQ / 2 )) $SEQ $(( 2 * SEQ ))}"
CACHE="${LONGCTX_CACHE:-$PWD/data_cache}"
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
if [ -e "$ROOT/multirun" ]; then
  echo "position_ablation: $ROOT/multirun exists (an earlier run); pass another RUNS_ROOT" >&2
  exit 2
fi
start=$SECONDS
# the first run synthesizes the mix (experiment=position_ablation's ruler_mix) into $CACHE
"$PY" train.py -m experiment=position_ablation "model=$MODEL" "paths.root_dir=$ROOT" logger=csv \
  "paths.cache_dir=$CACHE" "ruler_mix.seed=$MIX_SEED" "ruler_mix.documents=$DOCS" \
  "data.seq_len=$SEQ" "data.micro_batch_size=$ROWS" "${start_from[@]}" \
  "trainer.max_steps=$STEPS" "trainer.val_check_interval=${VAL_EVERY:-$(( STEPS < 100 ? STEPS : 100 ))}" "$@"
sweep="$(ls -d "$ROOT"/multirun/train/* | sort | tail -1)"
for run in "$sweep"/*/; do
  "$PY" -m longctx.eval "$run/checkpoints/last.ckpt" --suite ruler --tasks "$TASKS" \
    --lengths $LENGTHS --depths 0 0.25 0.5 0.75 1 \
    --samples "$SAMPLES" --seed "$INSTANCE_SEED" --cache-dir "$CACHE"
done
seconds=$(( SECONDS - start ))
note="$MODEL $from_note, L=$SEQ, $STEPS steps x $ROWS rows per arm and seed, the embedded corpus + the long-range mix (seed $MIX_SEED) 1:1, train seeds 0 and 1, instance seed $INSTANCE_SEED; ${seconds} s wall"
"$PY" -m studies.analysis "$sweep" --out "$OUT.png" --title "$note"
"$PY" -m studies.ruler_report "$sweep" --arm-by position --json "${OUT}_ruler.json" \
  --extra "{\"mix_seed\": $MIX_SEED, \"mix_documents\": $DOCS, \"train_seeds\": [0, 1], \"wall_s\": $seconds}" \
  --note "$note"
echo "position_ablation: ${seconds} s in all; results in $sweep"
