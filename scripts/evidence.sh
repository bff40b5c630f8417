#!/usr/bin/env bash
# The evidence of issue 42, rerun: the positive control (stage 1) with three training seeds, then
# the position ablation's 2x2 arms and the context extension's RoPE arms, each x the same three
# seeds, stage-2 seed S continued from stage-1 seed S (so every arm difference is paired by
# seed). Every run trains on the out-of-distribution long-range mix (longctx.synthetic.ood:
# templates, keys and values the suite never scores) and is scored on the suite. Runs go two at a
# time (PARALLEL), one thread each.
#
#   scripts/evidence.sh [RUNS_ROOT] [PART ...]        PART: control position extension (default: all)
#   SEEDS=1 scripts/evidence.sh outputs/evidence      # one seed's three parts (one session's work)
#   scripts/evidence.sh outputs/evidence reports      # every part's reports from OUT_DIR/runs
#
# After each part its runs are archived to OUT_DIR/runs/PART (studies.archive: every
# result file and the run's record, no checkpoint) and the part's reports are rewritten from the
# whole archive, every seed archived so far (hierarchical, seed-paired intervals; per-instance
# .csv.gz and per-seed scores beside each JSON). The archive is what gets committed, so the series
# goes on over sessions: a run already archived is skipped. Stage 2 of seed S needs control seed
# S's checkpoint on this machine (checkpoints are never committed): run a seed's parts in one
# go. Resumable: a run whose suite results exist is skipped, one with checkpoints resumes
# (ckpt_path=last). It commits nothing. Each run's wall time and the load average before and
# after it go to OUT_DIR/runs/timing.csv. Runs archived into one archive from several RUNS_ROOTs
# or machines get their reports from it with the part `reports` (it runs and archives nothing).
# SMOKE=1: tiny steps, lengths and samples (the pipeline end to end in minutes; results
# meaningless).
#
# From the environment: SEEDS ("0 1 2"), PARALLEL (2), SEQ1 (256, the control's length), STEPS1
# (50000), SEQ2 (2048), STEPS2 (600), ROWS2 (2), MIX_DOCUMENTS (20000 per task at stage 1, 4000 at
# stage 2), SAMPLES (4 per task, length and depth), INSTANCE_SEED (0), OUT_DIR (docs/results/evidence),
# CONTROL_ARMS ("ruler_control ruler_control_nomix"), EVAL_TASKS, LENGTHS1, LENGTHS2,
# OWN_FORMAT_DOCS (256: held-out documents of its OOD formats each ruler_control seed is read on,
# generated and teacher-forced, into OUT_DIR/ood_control by python -m studies.ood_control; each
# position arm is read the same way at SEQ1 on as many and at SEQ2 on ANSWER_DOCS, into
# OUT_DIR/ood_position, reported by studies.ood_report).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOT="${1:-outputs/evidence}"
shift || true
PARTS="${*:-control position extension}"
source scripts/checks.sh
seeds() {  # NAME VALUE: one or more non-negative integers, space-separated
  [[ "$2" =~ ^[[:space:]]*[0-9]+([[:space:]]+[0-9]+)*[[:space:]]*$ ]] ||
    { echo "error: $1=$2; expected seeds, non-negative integers separated by spaces (\"0 1 2\")" >&2; exit 2; }
}
SMOKE="${SMOKE:-0}"
one_of SMOKE "$SMOKE" 0 1
if [ "$SMOKE" = 1 ]; then  # every size tiny: proves the pipeline, measures nothing
  : "${STEPS1:=4}" "${STEPS2:=2}" "${SEQ2:=512}" "${ROWS2:=1}" "${MIX_DOCUMENTS:=30}" "${SAMPLES:=1}"
  : "${LENGTHS1:=256 512}" "${LENGTHS2:=256 512}" "${SEEDS:=0 1}" "${OUT_DIR:=$ROOT/reports}"
  : "${EVAL_TASKS:=niah_single_1,niah_multikey_2,lc_passkey,lc_niah_multikey}"
  : "${ANSWER_DOCS:=4}" "${OWN_FORMAT_DOCS:=4}"
fi
SEEDS="${SEEDS:-0 1 2}" PARALLEL="${PARALLEL:-2}" SEQ1="${SEQ1:-256}" STEPS1="${STEPS1:-50000}"
SEQ2="${SEQ2:-2048}" STEPS2="${STEPS2:-600}" ROWS2="${ROWS2:-2}" SAMPLES="${SAMPLES:-4}"
DOCS1="${MIX_DOCUMENTS:-20000}" DOCS2="${MIX_DOCUMENTS:-4000}" INSTANCE_SEED="${INSTANCE_SEED:-0}"
OUT_DIR="${OUT_DIR:-docs/results/evidence}" CONTROL_ARMS="${CONTROL_ARMS:-ruler_control ruler_control_nomix}"
ANSWER_DOCS="${ANSWER_DOCS:-64}" OWN_FORMAT_DOCS="${OWN_FORMAT_DOCS:-256}" ARCHIVE="$OUT_DIR/runs"
# every number checked before one is used (a LENGTHS default is arithmetic on SEQ1 and SEQ2)
for var in SEQ1 STEPS1 SEQ2 STEPS2 ROWS2 SAMPLES DOCS1 DOCS2 PARALLEL ANSWER_DOCS OWN_FORMAT_DOCS; do
  positive_int "$var" "${!var}"
done
seeds SEEDS "$SEEDS"
seeds INSTANCE_SEED "$INSTANCE_SEED"
[ "$(wc -w <<< "$INSTANCE_SEED")" = 1 ] || { echo "error: INSTANCE_SEED=$INSTANCE_SEED; expected one seed" >&2; exit 2; }
# RULER's tasks that need no --qa-data (a length below a task's minimum is skipped and said),
# and longctx's own needles, which fit the control's 256 tokens
EVAL_TASKS="${EVAL_TASKS:-niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe,lc_passkey,lc_niah_single,lc_niah_multikey}"
# the control's length and beyond; stage 2: the control's length (256: keeps, gains or loses)
# up to 2x the new one
LENGTHS1="${LENGTHS1:-$SEQ1 $(( 2 * SEQ1 )) $(( 4 * SEQ1 ))}"
LENGTHS2="${LENGTHS2:-$SEQ1 $(( SEQ2 / 4 )) $(( SEQ2 / 2 )) $SEQ2 $(( 2 * SEQ2 ))}"
OOD="ood_ledger,ood_locker,ood_relay,ood_echo"
for n in $LENGTHS1; do positive_int LENGTHS1 "$n"; done
for n in $LENGTHS2; do positive_int LENGTHS2 "$n"; done
for part in $PARTS; do one_of PART "$part" control position extension reports; done
if [[ " $PARTS " == *" reports "* ]] &&
   [ -z "$(find "$ARCHIVE" -mindepth 2 -maxdepth 2 -name 'seed*' 2>/dev/null)" ]; then
  echo "error: PART=reports with nothing archived in $ARCHIVE; expected OUT_DIR/runs/<part>/seed<S>/..." >&2
  exit 2
fi
CACHE="${LONGCTX_CACHE:-$PWD/data_cache}"
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true OMP_NUM_THREADS=1
mkdir -p "$ROOT" "$ARCHIVE"
TIMING="$ARCHIVE/timing.csv"
[ -e "$TIMING" ] || echo "part,run,seed,wall_s,load1_before,load1_after,status" > "$TIMING"
start=$SECONDS

# ------------------------------------------------------------------------ one run, resumable
# run PART NAME SEED FOLDER EVAL_ARGS -- TRAIN_ARGS...: train (or resume), then score on the suite
run() {
  local part=$1 name=$2 seed=$3 folder=$4 eval_args=$5; shift 6
  if [ -e "$ARCHIVE/${folder#"$ROOT"/}/run_record.json" ]; then
    echo "evidence: $folder archived, skipped"; return
  fi
  if [ -e "$folder/eval/ruler/ruler.json" ]; then echo "evidence: $folder done, skipped"; return; fi
  local resume=() t=$SECONDS load status=ok
  load=$(cut -d' ' -f1 /proc/loadavg)
  [ -e "$folder/checkpoints/last.ckpt" ] && resume=("ckpt_path=last")
  mkdir -p "$(dirname "$folder")"
  {
    "$PY" train.py logger=csv "paths.cache_dir=$CACHE" "seed=$seed" "${resume[@]}" "$@" &&
      $eval_args &&
      "$PY" -m longctx.eval "$folder/checkpoints/last.ckpt" --suite ruler --tasks "$EVAL_TASKS" \
        --depths 0 0.25 0.5 0.75 1 --samples "$SAMPLES" --seed "$INSTANCE_SEED" \
        --cache-dir "$CACHE" --lengths ${LENGTHS}
  } > "$folder.log" 2>&1 || status=failed
  echo "$part,$name,$seed,$(( SECONDS - t )),$load,$(cut -d' ' -f1 /proc/loadavg),$status" >> "$TIMING"
  [ "$status" = ok ] || { echo "evidence: $name (seed $seed) failed: $folder.log" >&2; return 1; }
}

# PARALLEL runs at a time; a failed run fails the part once the others have finished
jobs_failed=0
spawn() {
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n || jobs_failed=1; done
  [ "$jobs_failed" = 0 ] || return 0  # after a failure, start no more runs (drain says so)
  run "$@" &
}
drain() {
  while [ -n "$(jobs -rp)" ]; do wait -n || jobs_failed=1; done
  [ "$jobs_failed" = 0 ] || { echo "evidence: a run failed (RUNS_ROOT/*.log)" >&2; exit 1; }
}
# the part's runs into the archive; the reports then read every seed archived so far
archive() { "$PY" -m studies.archive "$ROOT/$1" "$ARCHIVE/$1"; }
archived_seeds() { echo $(ls "$ARCHIVE/$1" | sed -n 's/^seed//p' | sort -n); }
note() { echo "$1; seeds $(archived_seeds "$2"); instance seed $INSTANCE_SEED; wall times: runs/timing.csv"; }
# a part's reports, rewritten from every seed of it archived so far
report_control() {
  "$PY" -m studies.ruler_report "$ARCHIVE/control" --arm-by group --control ruler_control \
    --json "$OUT_DIR/control.json" --note "$(note "control: tiny_long at $SEQ1, $STEPS1 steps, the OOD mix ($OOD) + repeat vs none" control)"
}
report_position() {
  "$PY" -m studies.analysis "$ARCHIVE/position" --out "$OUT_DIR/position.png" \
    --title "$(note "position ablation from each seed's control, L=$SEQ2, $STEPS2 x $ROWS2 rows" position)"
  "$PY" -m studies.ruler_report "$ARCHIVE/position" --arm-by position \
    --json "$OUT_DIR/position_ruler.json" --note "$(note "position ablation, L=$SEQ2" position)"
  "$PY" -m studies.ood_report "$OUT_DIR/ood_position" --json "$OUT_DIR/ood_position.json" \
    --note "$(note "position arms in the training formats at $SEQ1 and $SEQ2" position)"
}
report_extension() {
  "$PY" -m studies.extension_report "$ARCHIVE/extension" --json "$OUT_DIR/extension.json" \
    --out "$OUT_DIR/extension.png" --note "$(note "context extension $SEQ1 -> $SEQ2 from each seed's control" extension)"
  "$PY" -m studies.ruler_report "$ARCHIVE/extension" --arm-by rope_arm --control unchanged \
    --json "$OUT_DIR/extension_ruler.json" --note "$(note "context extension, RoPE arms" extension)"
}
# own_formats RUN FOLDER NAME LENGTH DOCUMENTS: a run read on held-out documents of its OOD
# training formats (generation and teacher forcing), once: the checkpoint stays on this machine
own_formats() {
  [ -e "$OUT_DIR/$2/$3.json" ] || "$PY" -m studies.ood_control "$1" --out "$OUT_DIR/$2" \
    --name "$3" --length "$4" --documents "$5"
}
control_of() { echo "$ROOT/control/seed$1/outputs/train/ruler_control"; }
# stage 2 of a seed starts from its control's checkpoint, which only the machine that trained
# it holds: refuse before training rather than fail in every run
need_control() {  # SEED PART (both stage-2 parts have four arms a seed)
  local ckpt
  ckpt="$(control_of "$1")/checkpoints/last.ckpt"
  # (a substitution inside the test: find fails on an absent archive, which pipefail would
  # turn into a silent exit of the whole script)
  [ -e "$ckpt" ] ||
    [ "$(find "$ARCHIVE/$2/seed$1" -name run_record.json 2>/dev/null | wc -l)" -ge 4 ] || {
    echo "error: stage 2 of seed $1 needs $ckpt, which is not on this machine (checkpoints are" \
      "never committed); run the seed's control here first (SEEDS=$1 $0 $ROOT control $2; a" \
      "control already archived under $ARCHIVE/control/seed$1 must be removed to be retrained)" >&2
    exit 2
  }
}

# ---------------------------------------------------------- part 1: the control, three seeds
if [[ " $PARTS " == *" control "* ]]; then
  LENGTHS="$LENGTHS1"
  for seed in $SEEDS; do
    for arm in $CONTROL_ARMS; do
      mix=()
      [ "$arm" = ruler_control ] && mix=("ruler_mix.tasks=[$OOD]" "ruler_mix.documents=$DOCS1"
                                         "ruler_repeat.documents=$(( 3 * DOCS1 ))")
      spawn control "$arm" "$seed" "$ROOT/control/seed$seed/outputs/train/$arm" true -- \
        "experiment=$arm" "run_name=$arm" "paths.root_dir=$ROOT/control/seed$seed" \
        "data.seq_len=$SEQ1" "trainer.max_steps=$STEPS1" "${mix[@]}" \
        "trainer.val_check_interval=$(( STEPS1 < 5000 ? STEPS1 : 5000 ))" \
        "callbacks.ruler.tasks=[lc_passkey,lc_niah_single]"
    done
  done
  drain
  # the OOD control read in its own formats (generation and answer loss), beside the suite
  if [[ " $CONTROL_ARMS " == *" ruler_control "* ]]; then
    for seed in $SEEDS; do
      own_formats "$(control_of "$seed")" ood_control "ruler_control_s$seed" "$SEQ1" "$OWN_FORMAT_DOCS"
    done
  fi
  archive control
  report_control
fi

# stage 2 continues each seed's control: its model (the RoPE arms set their own theta and
# scaling; the position arms keep the control's theta 10,000)
from_control=(model=tiny_long optim.optimizer.lr=1e-3 "data.seq_len=$SEQ2"
  "data.micro_batch_size=$ROWS2" "trainer.max_steps=$STEPS2" "trainer.val_check_interval=$STEPS2"
  "ruler_mix.tasks=[$OOD]" "ruler_mix.documents=$DOCS2" hydra.mode=RUN)

# ------------------------------------------- part 2: the position ablation, 2x2 arms x seeds
if [[ " $PARTS " == *" position "* ]]; then
  LENGTHS="$LENGTHS2"
  for seed in $SEEDS; do need_control "$seed" position; done
  for seed in $SEEDS; do
    for reset in true false; do
      for mask in true false; do
        name="reset_${reset}_mask_$mask"  # the report reads the arm from the run's settings
        spawn position "$name" "$seed" "$ROOT/position/seed$seed/outputs/train/$name" true -- \
          experiment=position_ablation "run_name=$name" "paths.root_dir=$ROOT/position/seed$seed" \
          "model.init_from=$(control_of "$seed")" "data.reset_position_ids=$reset" \
          "data.document_mask=$mask" "${from_control[@]}" model.rope_theta=10000.0 \
          "data.weights=[0.14,0.86]" \
          "callbacks.ruler.tasks=[lc_passkey,lc_niah_single]" \
          "callbacks.held_out_answers.documents=$ANSWER_DOCS"
      done
    done
  done
  drain
  # every arm in the training formats, at the control's length (kept?) and at its own
  for seed in $SEEDS; do
    for run in "$ROOT/position/seed$seed/outputs/train"/reset_*/; do
      run=${run%/}
      [ -d "$run" ] || continue  # no arm of this seed trained here (its readings came with it)
      own_formats "$run" ood_position "$(basename "$run")_s${seed}_at$SEQ1" "$SEQ1" "$OWN_FORMAT_DOCS"
      own_formats "$run" ood_position "$(basename "$run")_s${seed}_at$SEQ2" "$SEQ2" "$ANSWER_DOCS"
    done
  done
  archive position
  report_position
fi

# ------------------------------------------- part 3: the context extension, RoPE arms x seeds
if [[ " $PARTS " == *" extension "* ]]; then
  LENGTHS="$LENGTHS2"
  for seed in $SEEDS; do need_control "$seed" extension; done
  for seed in $SEEDS; do
    for arm in unchanged abf linear yarn; do
      folder="$ROOT/extension/seed$seed/outputs/train/rope_arm=$arm"
      spawn extension "rope_arm=$arm" "$seed" "$folder" \
        "$PY -m longctx.eval $folder/checkpoints/last.ckpt --cache-dir $CACHE --long-factor 4 --probe-samples $SAMPLES" -- \
        experiment=context_extension "rope_arm=$arm" "run_name='rope_arm=$arm'" \
        "paths.root_dir=$ROOT/extension/seed$seed" "model.init_from=$(control_of "$seed")" \
        "stage1_seq_len=$SEQ1" "${from_control[@]}"
    done
  done
  drain
  archive extension
  report_extension
fi

# --------------------------------------- the reports alone, from whatever the archive holds
if [[ " $PARTS " == *" reports "* ]]; then
  for part in control position extension; do
    if [ -d "$ARCHIVE/$part" ]; then "report_$part"; else echo "evidence: no $ARCHIVE/$part"; fi
  done
fi
echo "evidence: $(( SECONDS - start )) s; runs in $ROOT, their archive in $ARCHIVE (timing.csv), reports in $OUT_DIR"
