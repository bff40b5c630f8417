#!/usr/bin/env bash
# The associative-recall study (issue 53; docs/recall.md): the 2x2 reset_position_ids x
# document_mask on MQAR in packed rows, SEEDS training seeds per arm, PARALLEL runs at a time
# (one thread each). Each run trains two stages: experiment=recall_stage1 (documents of 2..4
# pairs: they break MQAR's plateau), then experiment=recall from its weights. Each run is scored (python -m studies.recall: every held-out
# instance teacher-forced, the in-distribution rows through generation too, which must agree)
# into OUT_DIR/scores, its wall times and the load average beside it in OUT_DIR/timing.csv; a
# masked run is read again under the other position ids (OUT_DIR/swapped: the masked pair with
# the same weights); then the report (python -m studies.recall_report) is rewritten from every
# score so far.
# Resumable: a run whose scores exist is skipped; one with a checkpoint resumes (ckpt_path=last).
# Commits nothing; the scores and the report are what to commit (never the checkpoints).
#
#   scripts/recall_study.sh [RUNS_ROOT]
#   SEEDS="0 1" scripts/recall_study.sh           # some seeds: a session's share
#   SMOKE=1 scripts/recall_study.sh /tmp/smoke    # tiny sizes: the pipeline in minutes
#
# From the environment: SEEDS ("0 1 2 3 4"), ARMS ("true,true true,false false,true
# false,false": document_mask,reset_position_ids), PARALLEL (2), STAGE1_STEPS and STEPS (the
# experiments' recall_stage1 and recall),
# ROWS (8 rows per packed condition), DOCS (16 length documents per distance), OUT_DIR
# (docs/results/recall), EXTRA (more train.py overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/recall}"
source scripts/checks.sh
SMOKE="${SMOKE:-0}"
one_of SMOKE "$SMOKE" 0 1
if [ "$SMOKE" = 1 ]; then  # every size tiny: proves the pipeline, measures nothing
  : "${STEPS:=3}" "${STAGE1_STEPS:=3}" "${ROWS:=1}" "${DOCS:=1}" "${SEEDS:=0 1}" "${OUT_DIR:=$ROOT/report}"
  EXTRA="data.seq_len=256 data.val_rows=1 trainer.val_check_interval=3 ${EXTRA:-}"
  EXTRA="$EXTRA data.shards=[{mqar:{documents:400,seed:0,val_documents:20}}]"
fi
SEEDS="${SEEDS:-0 1 2 3 4}" PARALLEL="${PARALLEL:-2}" ROWS="${ROWS:-8}" DOCS="${DOCS:-16}"
ARMS="${ARMS:-true,true true,false false,true false,false}" OUT_DIR="${OUT_DIR:-docs/results/recall}"
for var in PARALLEL ROWS DOCS; do positive_int "$var" "${!var}"; done
for var in STEPS STAGE1_STEPS; do [ -z "${!var:-}" ] || positive_int "$var" "${!var}"; done
[[ "$SEEDS" =~ ^[[:space:]]*[0-9]+([[:space:]]+[0-9]+)*[[:space:]]*$ ]] ||
  { echo "error: SEEDS=$SEEDS; expected seeds, non-negative integers separated by spaces" >&2; exit 2; }
for arm in $ARMS; do
  [[ "$arm" =~ ^(true|false),(true|false)$ ]] ||
    { echo "error: ARMS entry $arm; expected document_mask,reset_position_ids as true/false" >&2; exit 2; }
done
mkdir -p "$OUT_DIR/scores"
[ -f "$OUT_DIR/timing.csv" ] ||
  echo "run,seed,document_mask,reset_position_ids,train_s,score_s,load_before,load_after" > "$OUT_DIR/timing.csv"

train_stage() {  # experiment run_name log [overrides...]: trains, or resumes an unfinished run
  local experiment=$1 name=$2 log=$3; shift 3
  local resume=()
  [ -e "$ROOT/outputs/train/$name/checkpoints/last.ckpt" ] && resume=(ckpt_path=last)
  # shellcheck disable=SC2086  # EXTRA is a list of overrides
  OMP_NUM_THREADS=1 "$PY" train.py experiment="$experiment" run_name="$name" \
    paths.root_dir="$ROOT" logger=csv "$@" ${EXTRA:-} "${resume[@]}" >> "$log" 2>&1 ||
    { echo "error: training $name failed; see $log" >&2; return 1; }
}

score() {  # run name log folder [options...]: the held-out instances, into OUT_DIR/folder
  local run=$1 name=$2 log=$3 folder=$4; shift 4
  OMP_NUM_THREADS=1 "$PY" -m studies.recall "$run" --out "$OUT_DIR/$folder" \
    --name "$name" --rows "$ROWS" --docs "$DOCS" "$@" >> "$log" 2>&1 ||
    { echo "error: scoring $name ($folder) failed; see $log" >&2; return 1; }
}

run_one() {  # document_mask reset_position_ids seed
  local mask=$1 reset=$2 seed=$3
  local name="recall_m${mask:0:1}_r${reset:0:1}_s${seed}"
  local run="$ROOT/outputs/train/$name" log="$ROOT/$name.log"
  if [ -f "$OUT_DIR/scores/$name.json" ]; then
    echo "recall_study: $name scored, skipped"
  else
    train_and_score "$mask" "$reset" "$seed" "$name" "$run" "$log" || return 1
  fi
  if [ "$mask" = true ] && [ ! -f "$OUT_DIR/swapped/$name.json" ]; then
    score "$run" "$name" "$log" swapped --positions swapped
  fi
}

train_and_score() {  # document_mask reset_position_ids seed name run log
  local mask=$1 reset=$2 seed=$3 name=$4 run=$5 log=$6
  local arm=(seed="$seed" data.document_mask="$mask" data.reset_position_ids="$reset")
  local load0 t0 t1 t2
  load0=$(cut -d' ' -f1 /proc/loadavg); t0=$(date +%s)
  # stage 1 (documents of 2..4 pairs) is done once stage 2's folder exists: stage 2 starts from
  # its last checkpoint, and resuming stage 2 does not read it again
  if [ ! -e "$run/checkpoints/last.ckpt" ]; then
    train_stage recall_stage1 "${name}_stage1" "$log" "${arm[@]}" \
      ${STAGE1_STEPS:+trainer.max_steps=$STAGE1_STEPS} || return 1
  fi
  train_stage recall "$name" "$log" "${arm[@]}" model.init_from="$ROOT/outputs/train/${name}_stage1" \
    ${STEPS:+trainer.max_steps=$STEPS} || return 1
  t1=$(date +%s)
  score "$run" "$name" "$log" scores --generate in_distribution || return 1
  t2=$(date +%s)
  echo "$name,$seed,$mask,$reset,$((t1 - t0)),$((t2 - t1)),$load0,$(cut -d' ' -f1 /proc/loadavg)" \
    >> "$OUT_DIR/timing.csv"
  echo "recall_study: $name trained (both stages) in $((t1 - t0)) s, scored in $((t2 - t1)) s"
}
export -f train_stage score run_one train_and_score
export PY ROOT OUT_DIR ROWS DOCS STEPS STAGE1_STEPS EXTRA
mkdir -p "$ROOT"
for seed in $SEEDS; do for arm in $ARMS; do echo "${arm/,/ } $seed"; done; done |
  xargs -P "$PARALLEL" -L 1 bash -c 'run_one "$@"' _
swapped=()
[ -d "$OUT_DIR/swapped" ] && swapped=(--swapped "$OUT_DIR/swapped")
"$PY" -m studies.recall_report "$OUT_DIR/scores" --out "$OUT_DIR" "${swapped[@]}"
