#!/usr/bin/env bash
# One prepared GPU check, for the day a CUDA machine is lent (one call, under 10 minutes where vLLM is absent):
#   1. print the environment (torch, GPU, flash-attn / torch varlen availability);
#   2. run the gpu-marked tests (tests/gpu/test_attention_gpu.py, and any other *_gpu.py module);
#   3. run the leak probe on flash, flex and sdpa in fp32 and bf16 (longctx.probe.backends: a
#      backend this machine lacks, e.g. flash without a varlen kernel, is listed as skipped);
#   4. serve a small export with vLLM when it is importable (scripts/vllm_export_check.py);
#   5. run benchmarks/gpu_bench.py (attention backends at 8k/32k, 2-layer 8B-shape train step).
# Installs nothing: the repo is put on PYTHONPATH (the GPU machine has no network, and pip's
# isolated editable build would need to fetch setuptools). Results and logs go to $OUT if set,
# else benchmarks/results/gpu/; the benchmark table is printed last.
#
#   bash scripts/gpu_check.sh              # on the GPU machine
#   bash scripts/gpu_check.sh --cpu-smoke  # here: same steps, tiny, on CPU (tests skip)
set -uo pipefail

cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the project's venv where there is one (this machine), else the python that holds torch there
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
BENCH_ARGS=()
TEST_TIMEOUT=250   # flex compiles once per test shape (~20-60 s each)
BENCH_TIMEOUT=180  # SIGINT at the limit: gpu_bench prints the stages that finished
PROBE_ARGS=(--backends flash,sdpa,flex --seq-len 1024)
PROBE_TIMEOUT=110  # flex compiles once per shape (the row and each document length)
if [ "${1:-}" = "--cpu-smoke" ]; then
    BENCH_ARGS=(--cpu-smoke)
    PROBE_ARGS=(--device cpu --backends sdpa,flex,eager --seq-len 512)
    TEST_TIMEOUT=120
    BENCH_TIMEOUT=240
fi

echo "== environment"
"$PY" - <<'EOF' 2>&1 | tee "$RESULTS/environment.txt"
import importlib.util, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
print("flash_attn importable:", importlib.util.find_spec("flash_attn") is not None)
try:
    from torch.nn.attention.varlen import varlen_attn
    import inspect
    print("torch varlen_attn:", inspect.signature(varlen_attn))
except ImportError as err:
    print("torch varlen_attn: absent", err)
print("triton:", importlib.util.find_spec("triton") is not None)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

echo "== gpu tests"
GPU_TESTS=(tests/gpu/test_attention_gpu.py)
for f in tests/gpu/test_*_gpu.py; do
    [ "$f" != tests/gpu/test_attention_gpu.py ] && [ -f "$f" ] && GPU_TESTS+=("$f")
done
# -p no:cacheprovider: the checkout may be read-only-ish there; -rs lists skips with reasons
timeout "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${GPU_TESTS[@]}" \
    2>&1 | tee "$RESULTS/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}
[ "$TEST_RC" = 124 ] && echo "gpu tests: TIMED OUT after ${TEST_TIMEOUT}s"
echo "gpu tests rc=$TEST_RC (0 = passed; see $RESULTS/gpu_tests.log)"

echo "== leak probe"
timeout "$PROBE_TIMEOUT" "$PY" -m longctx.probe.backends "${PROBE_ARGS[@]}" --out "$RESULTS" \
    2>&1 | tee "$RESULTS/leak_probe.log"
PROBE_RC=${PIPESTATUS[0]}
[ "$PROBE_RC" = 124 ] && echo "leak probe: TIMED OUT after ${PROBE_TIMEOUT}s"
echo "leak probe rc=$PROBE_RC (0 = every probed backend passed; see $RESULTS/backends.json)"

echo "== vllm on an export (only where vllm is importable)"
# a small export served by vLLM: its derived max_model_len and greedy tokens vs transformers'
timeout 300 "$PY" scripts/vllm_export_check.py "$RESULTS/vllm" 2>&1 | tee "$RESULTS/vllm_check.log"
VLLM_RC=${PIPESTATUS[0]}
echo "vllm check rc=$VLLM_RC (0 = passed or skipped; see $RESULTS/vllm_check.log)"

echo "== gpu benchmark"
timeout -s INT -k 30 "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_bench.py "${BENCH_ARGS[@]}" \
    2>&1 | tee "$RESULTS/gpu_bench.log"
BENCH_RC=${PIPESTATUS[0]}
[ "$BENCH_RC" = 124 ] && echo "gpu benchmark: TIMED OUT after ${BENCH_TIMEOUT}s"
# the benchmark's table is the last thing printed; the exit status carries every step's result
[ "$TEST_RC" = 0 ] && [ "$PROBE_RC" = 0 ] && [ "$VLLM_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
