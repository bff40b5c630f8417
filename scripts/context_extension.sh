#!/usr/bin/env bash
# The context-extension recipe (issues #22, #34), once per training seed: stage 1 trains the tiny
# model at 256 tokens (experiment=context_extension_stage1), stage 2 extends it 8x to 2048 as a
# multirun over the RoPE arms {unchanged, ABF theta x50, linear, YaRN} from stage 1's weights
# (experiment=context_extension, model.init_from); both stages read the embedded corpus mixed 1:1
# with synthesized long-range documents (the experiments' ruler_mix: each stage's first run
# synthesizes it into the cache, later ones reuse it). Every arm is then evaluated on the long held-out documents out to 4x its length with
# the passkey probe, and on the effective-length suite at 1/4 .. 4x its length (the same
# instances for every arm and seed); the per-seed table and figure are written
# (python -m studies.extension_report), then the suite per arm over both seeds, paired with
# unchanged RoPE, with effective lengths and heat maps (python -m studies.ruler_report).
#
#   scripts/context_extension.sh [RUNS_ROOT] [extra overrides for both stages ...]
#
# Sizes from the environment: SEEDS (training seeds, default "0 1"; seed S runs in RUNS_ROOT/seedS),
# SEQ1 (stage 1's length, default 256; stage 2 is 8x it), STEPS1 (default 600 steps of 8 x SEQ1),
# STEPS2 (150 steps of ROWS2 (1) x 8 SEQ1 per arm), PROBE_SAMPLES (4 per length and depth), RULER_SAMPLES
# (4 per task, length and depth), MIX_SEED (1000), MIX_TASKS (kv_recall,copy,lc_passkey,lc_niah_single),
# MIX_DOCUMENTS (4000 per task), INSTANCE_SEED (0); FIGURE (default
# docs/results/context_extension/context_extension.png: each seed's table and numbers go beside it as
# _s<seed>.png/.json, the suite's report as _ruler.json/.png); STAGE1 (a trained run folder or
# checkpoint to extend instead of training stage 1: every seed's stage 2 starts from it, and the
# extra overrides must name its model, e.g. model=tiny_long model.rope_theta=10000).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/context_extension}"
shift || true
SEEDS="${SEEDS:-0 1}" SEQ1="${SEQ1:-256}" STEPS1="${STEPS1:-600}" STEPS2="${STEPS2:-150}" ROWS2="${ROWS2:-1}"
PROBE_SAMPLES="${PROBE_SAMPLES:-4}" RULER_SAMPLES="${RULER_SAMPLES:-4}" SEQ2=$(( 8 * SEQ1 ))
MIX_SEED="${MIX_SEED:-1000}" MIX_DOCUMENTS="${MIX_DOCUMENTS:-4000}" INSTANCE_SEED="${INSTANCE_SEED:-0}"
MIX_TASKS="${MIX_TASKS:-kv_recall,copy,lc_passkey,lc_niah_single}"
FIGURE="${FIGURE:-docs/results/context_extension/context_extension.png}"
CACHE="${LONGCTX_CACHE:-$PWD/data_cache}"
TASKS="lc_passkey,lc_niah_single,lc_copy"
# 1/4 and 1/2 of the final length (at least the needle tasks' minimum), 1x, 2x and 4x
LOW=$(( SEQ2 / 4 < 192 ? 192 : SEQ2 / 4 ))
LENGTHS=$(printf '%s\n' "$LOW" $(( SEQ2 / 2 )) "$SEQ2" $(( 2 * SEQ2 )) $(( 4 * SEQ2 )) \
  | awk -v low="$LOW" '$1 >= low' | sort -n -u | tr '\n' ' ')
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
for seed in $SEEDS; do
  if [ -e "$ROOT/seed$seed/outputs/train/stage1" ] || [ -e "$ROOT/seed$seed/multirun" ]; then
    echo "context_extension: $ROOT/seed$seed exists (an earlier recipe run); pass another RUNS_ROOT" >&2
    exit 2
  fi
done
start=$SECONDS
# the mix's settings (its length is the stage's data.seq_len)
mix=("ruler_mix.seed=$MIX_SEED" "ruler_mix.documents=$MIX_DOCUMENTS" "ruler_mix.tasks=[$MIX_TASKS]")
STAGE1="${STAGE1:-}"
source scripts/checks.sh
for var in SEQ1 STEPS1 STEPS2 ROWS2; do positive_int "$var" "${!var}"; done
existing_path STAGE1 "$STAGE1"
if [ -n "$STAGE1" ]; then stage1_note="stage 1: $STAGE1 (given)"
else stage1_note="tiny, stage 1: $STEPS1 x 8 x $SEQ1"; fi

for seed in $SEEDS; do
  runs="$ROOT/seed$seed"
  stage1="${STAGE1:-$runs/outputs/train/stage1}"
  if [ -z "$STAGE1" ]; then
    "$PY" train.py experiment=context_extension_stage1 run_name=stage1 "paths.root_dir=$runs" \
      logger=csv "paths.cache_dir=$CACHE" "seed=$seed" "data.seq_len=$SEQ1" \
      "${mix[@]}" "trainer.max_steps=$STEPS1" \
      "trainer.val_check_interval=$(( STEPS1 < 200 ? STEPS1 : 200 ))" "$@"
  fi

  "$PY" train.py -m experiment=context_extension "model.init_from=$stage1" \
    "paths.root_dir=$runs" logger=csv "paths.cache_dir=$CACHE" "seed=$seed" \
    "stage1_seq_len=$SEQ1" "data.seq_len=$SEQ2" "data.micro_batch_size=$ROWS2" "${mix[@]}" \
    "trainer.max_steps=$STEPS2" "trainer.val_check_interval=$(( STEPS2 < 50 ? STEPS2 : 50 ))" "$@"
  sweep="$(ls -d "$runs"/multirun/train/* | sort | tail -1)"

  for arm in "$sweep"/*rope_arm=*/; do
    "$PY" -m longctx.eval "$arm/checkpoints/last.ckpt" --cache-dir "$CACHE" --long-factor 4 \
      --probe-samples "$PROBE_SAMPLES"
    "$PY" -m longctx.eval "$arm/checkpoints/last.ckpt" --cache-dir "$CACHE" --long-factor 4 \
      --suite ruler --tasks "$TASKS" --lengths $LENGTHS --depths 0 0.25 0.5 0.75 1 \
      --samples "$RULER_SAMPLES" --seed "$INSTANCE_SEED"
  done
  "$PY" -m studies.extension_report "$sweep" --out "${FIGURE%.*}_s$seed.png" \
    --json "${FIGURE%.*}_s$seed.json" --note \
    "seed $seed, $stage1_note, stage 2: $STEPS2 x $ROWS2 x $SEQ2 per arm, the long-range mix (seed $MIX_SEED) 1:1; $(( SECONDS - start )) s wall so far"
done
seconds=$(( SECONDS - start ))
"$PY" -m studies.ruler_report "$ROOT" --arm-by rope_arm --control unchanged \
  --json "${FIGURE%.*}_ruler.json" \
  --extra "{\"train_seeds\": [$(echo $SEEDS | tr ' ' ',')], \"mix_seed\": $MIX_SEED, \"final_length\": $SEQ2, \"wall_s\": $seconds}" \
  --note "$stage1_note, stage 2: $STEPS2 x $ROWS2 x $SEQ2 per RoPE arm, seeds $SEEDS, the long-range mix (seed $MIX_SEED) 1:1, instance seed $INSTANCE_SEED; ${seconds} s wall"
echo "context_extension: ${seconds} s in all; results in $ROOT"
