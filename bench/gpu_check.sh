#!/usr/bin/env bash
# The GPU check: one command on a CUDA machine without a network, within 8 minutes
# (docs/benchmarks.md, "GPU check"). Prepare here first, with a network:
#
#   bash bench/gpu_check.sh --prepare      # wheels and SmolLM2's files into .gpu-check/
#
# then, on the machine, from the repository root (.gpu-check carried along):
#
#   bash bench/gpu_check.sh                # figures in $OUT/gpu_check.txt, $OUT/serve.json
#
# Steps, each bounded by `timeout`: install the project's requirements from the wheels
# (what the machine already has in a fitting version stays), print the environment (torch,
# CUDA, the GPU), give SmolLM2-135M's shape random weights, run the model-equivalence tests
# on the GPU in bf16 (TANDEM_TEST_DEVICE/TANDEM_TEST_DTYPE, tandem_testing/device.py), the
# worker-step benchmark and bench/serve.py against Tandem alone. A failed step is reported
# and the next one runs; the exit status is 1 if any failed.
#
# Rehearsal on a CPU machine: GPU_CHECK_DEVICE=cpu GPU_CHECK_DTYPE=float32 GPU_CHECK_QUICK=1
# (a few tests, a short load) GPU_CHECK_SLACK=4 (every step's limit times 4).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [[ "${1:-}" == "--prepare" ]]; then
    PYTHONPATH=$ROOT:$ROOT/operator exec python3 bench/gpu_check.py prepare
fi

PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
QUICK=${GPU_CHECK_QUICK:-0}
SLACK=${GPU_CHECK_SLACK:-1}
OUT=${OUT:-$ROOT/.gpu-check/out}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
REPORT=$OUT/gpu_check.txt
mkdir -p "$OUT"
: >"$REPORT"
export PYTHONPATH=$ROOT:$ROOT/operator PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1
MODEL=$WORK/smollm2-random
FAILED=()
SUMMARY=()

# step NAME SECONDS COMMAND...: the command's output into the report (and on stdout)
step() {
    local name=$1 limit=$(($2 * SLACK)) start rc
    shift 2
    start=$(date +%s)
    printf '\n== %s (at most %ss): %s\n' "$name" "$limit" "$*" | tee -a "$REPORT"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$REPORT"
    rc=${PIPESTATUS[0]}
    SUMMARY+=("$(printf '%-12s rc %-3s %4ss' "$name" "$rc" "$(($(date +%s) - start))")")
    if ((rc != 0)); then
        FAILED+=("$name")
        printf '== %s FAILED: rc %s%s\n' "$name" "$rc" \
            "$( ((rc == 124 || rc == 137)) && echo ", over its ${limit}s")" | tee -a "$REPORT"
    fi
    return "$rc"
}

if ((QUICK)); then
    TESTS=(-k "tiny and not mrope or llama and not llama3")
    SERVE=(--concurrency 1 4 --num-prompts 4 --output-len 8 --input-len 32)
    STEP=(--batch 4 --prompt-tokens 128 --decode-steps 8 --reps 1)
else
    TESTS=(-k "not smollm2")
    SERVE=(--concurrency 1 16 64 --num-prompts 64 --output-len 32 --input-len 128)
    STEP=(--batch 16 --prompt-tokens 512 --decode-steps 32 --reps 3)
fi

# 45 + 20 + 35 + 115 + 75 + 180 = 470 s at the very most
step install 45 "$PY" -m pip install --no-index --find-links .gpu-check/wheels --no-compile \
    --disable-pip-version-check -q -r .gpu-check/requirements.txt
step environment 20 "$PY" bench/gpu_check.py environment
step model 35 "$PY" bench/gpu_check.py model .gpu-check/smollm2-shape "$MODEL"
step tests 115 env TANDEM_TEST_DEVICE="$DEVICE" TANDEM_TEST_DTYPE="$DTYPE" \
    "$PY" -m pytest -q -p no:randomly -p no:cacheprovider --timeout 120 \
    tests/test_model_equivalence.py tests/test_hf_model.py "${TESTS[@]}"
step worker_step 75 "$PY" bench/worker_step.py --model small --device "$DEVICE" "${STEP[@]}"
if [[ -f $MODEL/config.json ]]; then
    step serve 180 "$PY" bench/serve.py --engines tandem --model "$MODEL" --dtype "$DTYPE" \
        --tandem-args="--device $DEVICE" --rounds 1 --warmup 2 "${SERVE[@]}" \
        --work-dir "$WORK/serve" --out "$OUT/serve.json"
    # the engine's own log, for a failed or slow round
    find "$WORK/serve" -name tandem.log -exec tail -n 200 {} + >"$OUT/serve_tandem.log" 2>&1
else
    FAILED+=(serve)
    SUMMARY+=("serve        skipped: no model")
fi

{
    printf '\n== summary (device %s, dtype %s%s)\n' "$DEVICE" "$DTYPE" \
        "$( ((QUICK)) && echo ", quick")"
    printf '%s\n' "${SUMMARY[@]}"
    if ((${#FAILED[@]})); then echo "FAILED: ${FAILED[*]}"; else echo "all steps passed"; fi
} | tee -a "$REPORT"
rm -rf "$WORK"
((${#FAILED[@]} == 0))
