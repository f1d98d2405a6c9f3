#!/usr/bin/env bash
# The CUDA path on a real GPU, in one run: build, report, tests, benchmarks, summary.
#
#   bench/gpu_check.sh                  on a CUDA machine (about 9 minutes on an H200 host)
#   bench/gpu_check.sh --dry-run        print every phase's command, run nothing
#   bench/gpu_check.sh --cpu-rehearsal  the same phases on CPU with tiny sizes (no build; results
#                                       stay in the log directory, never in bench/results)
#   bench/gpu_check.sh --only step_time,summary   run only the named phases (e.g. a rerun)
#   bench/gpu_check.sh --skip-build     every phase but the build
#
# Phases: build (pip install --no-build-isolation --no-deps -e . with TORCH_CUDA_ARCH_LIST,
# ASTERIA_FORCE_CUDA=1), info (python -m asteria.info, and the GPU's name), tests (tests/gpu and
# the CUDA-relevant unit tests), profile (bench/profile_step.py on the tiny preset: where the
# host time of native and Asteria steps goes, torch.profiler and cProfile), host_overhead
# (bench/host_overhead.py: ATen ops, syncs and Python calls per step, counted), step_time (AdamW,
# native and Asteria SOAP and KL-Shampoo, with NVML energy per step), time_to_target
# (bench/time_to_target.py --device cuda on the tiny preset, at the committed CPU tuning's
# rates), memory (bench/memory.py --measure-cuda: max_memory_allocated), capacity
# (bench/capacity.py when present, else bench/gpu_refresh_time.py: device eigh/QR vs the CPU
# pool per factor size), summary (bench/gpu_summary.py: the figures against the goals).
#
# Each phase runs under `timeout`: its own limit, cut so that the phases after it keep their
# minimum within GPU_CHECK_BUDGET_S (default 540 s). A failing phase does not stop later ones;
# the exit code is 1 if any phase failed (0 otherwise; a missed goal is not a failure).
# Results: bench/results/<bench>_<gpu>.json (<gpu> from torch.cuda.get_device_name, lower-cased
# and sanitized: "NVIDIA H200" -> h200). Logs and results are written under build/gpu_check/;
# when $OUT is set, after every phase it receives, flat (the device tool brings back at most 8
# files): the results' JSON, phases.txt, gpu_summary.txt and gpu_check_logs.tar.gz (all logs).
# Knobs (environment): PYTHON, GPU_CHECK_BUDGET_S,
# GPU_CHECK_MODEL (olmo-150m), GPU_CHECK_LAYERS (12), GPU_CHECK_BATCH (32), GPU_CHECK_SEQ (512),
# GPU_CHECK_STEPS (60), GPU_CHECK_WORKERS (cores - 1), GPU_CHECK_TTT_PRESETS (tiny),
# GPU_CHECK_TTT_ARGS (more words for time_to_target, e.g. --modes native,asteria),
# TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
REHEARSAL=0
ONLY=""
SKIP_BUILD=0
while (($#)); do
    case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --cpu-rehearsal) REHEARSAL=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    --only)
        [[ $# -ge 2 ]] || { echo "gpu_check.sh: --only needs a list of phases" >&2; exit 2; }
        ONLY=$2
        shift
        ;;
    --only=*) ONLY=${1#--only=} ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

PHASES=(build info tests profile host_overhead step_time time_to_target memory capacity summary)
if [[ -n $ONLY ]]; then
    IFS=, read -r -a wanted <<<"$ONLY"
    for w in "${wanted[@]}"; do
        if [[ " ${PHASES[*]} " != *" $w "* ]]; then
            echo "gpu_check.sh: unknown phase '$w' (phases: ${PHASES[*]})" >&2
            exit 2
        fi
    done
fi

# -- settings ---------------------------------------------------------------------------------
CORES=$(nproc 2>/dev/null || echo 2)
WORKERS=${GPU_CHECK_WORKERS:-$((CORES > 1 ? CORES - 1 : 1))}
if ((REHEARSAL)); then
    DEVICE=cpu MODEL=nano LAYERS=1 BATCH=4 SEQ=32 STEPS=16 SKIP=4 MEM_STEPS=2
    SIZES=64,128,256 WORKERS=1 BUDGET_S=${GPU_CHECK_BUDGET_S:-900}
else
    DEVICE=cuda
    MODEL=${GPU_CHECK_MODEL:-olmo-150m}
    LAYERS=${GPU_CHECK_LAYERS:-12}
    BATCH=${GPU_CHECK_BATCH:-32}
    SEQ=${GPU_CHECK_SEQ:-512}
    STEPS=${GPU_CHECK_STEPS:-60}
    SKIP=10 MEM_STEPS=16 SIZES=256,512,1024,2048,4096
    BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$CORES}
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 # a crash prints every thread's Python stack into the phase's log
VARIANTS=adamw,soap_native,soap_asteria,kl_shampoo_native,kl_shampoo_asteria
# test_extension last: it took 85 s on the H200 host (its pool tests), the others seconds
UNIT_TESTS=(tests/unit/test_host_memory.py tests/unit/test_window.py tests/unit/test_tiers.py
    tests/unit/test_extension.py)

# The python: $PYTHON, else the first of these whose torch has CUDA (in a rehearsal: whose
# asteria imports).
pick_python() {
    local c
    for c in .venv-cuda/bin/python .venv/bin/python python3 python; do
        command -v "$c" >/dev/null 2>&1 || continue
        if ((DRY_RUN)); then echo "$c"; return 0; fi
        if ((REHEARSAL)); then
            # the first whose built extension loads (.venv-cuda's torch is not the CPU build's)
            "$c" -c 'import asteria' >/dev/null 2>&1 && { echo "$c"; return 0; }
        else
            "$c" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1 &&
                { echo "$c"; return 0; }
        fi
    done
    echo python3
}
PY=${PYTHON:-$(pick_python)}

LOG_DIR=$ROOT/build/gpu_check
RESULTS_OUT=$LOG_DIR/results
OUT=${OUT:-}
TAG="<gpu>"
GPU_NAME="<from torch.cuda.get_device_name>"
if ((REHEARSAL)); then TAG=cpu_rehearsal GPU_NAME="cpu (rehearsal)"; fi

declare -A MIN_S=([build]=60 [info]=15 [tests]=45 [profile]=40 [host_overhead]=30 [step_time]=100
    [time_to_target]=60
    [memory]=45 [capacity]=45 [summary]=15)
declare -A BOX_S=([build]=240 [info]=30 [tests]=150 [profile]=120 [host_overhead]=150 [step_time]=200
    [time_to_target]=240
    [memory]=90 [capacity]=90 [summary]=30)
if ((REHEARSAL)); then BOX_S[tests]=300; fi # the 2-core CPU runs the unit tests for minutes
declare -A STATUS=()
FAILED=0
START=$(date +%s)

selected() {
    local p=$1
    if [[ $p == build ]] && ((REHEARSAL)); then return 1; fi # never rebuild the CPU extension
    if [[ -n $ONLY ]]; then [[ ",$ONLY," == *",$p,"* ]]; return; fi
    if [[ $p == build ]] && ((SKIP_BUILD)); then return 1; fi
    return 0
}

# The limit of phase $1: its box, cut so that every selected phase after it keeps its minimum.
phase_limit() {
    local name=$1 later=0 seen=0 p
    for p in "${PHASES[@]}"; do
        if ((seen)) && selected "$p"; then later=$((later + MIN_S[$p])); fi
        [[ $p == "$name" ]] && seen=1
    done
    local left=$((BUDGET_S - ($(date +%s) - START) - later))
    local box=${BOX_S[$name]}
    echo $((left < box ? left : box))
}

# The command as one line to paste: words of plain characters as they are, others shell-quoted.
quote() {
    local a out=()
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            out+=("$a")
        else
            out+=("$(printf '%q' "$a")")
        fi
    done
    echo "${out[*]}"
}

# run_phase NAME [RESULT] -- CMD...: run CMD under timeout, log to $LOG_DIR/NAME.log; when RESULT
# is given, the log's last line (the benchmark's JSON) is saved as RESULT_<gpu>.json.
run_phase() {
    local name=$1 result=""
    shift
    if [[ $1 != -- ]]; then result=$1; shift; fi
    shift
    if ! selected "$name"; then
        STATUS[$name]="not selected"
        return 0
    fi
    local limit
    limit=$(phase_limit "$name")
    echo "== phase $name (timeout ${limit}s): $(quote "$@")"
    [[ -n $result ]] && echo "   result: bench/results/${result}_${TAG}.json"
    if ((DRY_RUN)); then
        STATUS[$name]="dry run"
        return 0
    fi
    if ((limit < 10)); then
        echo "   not run: ${limit}s left of the ${BUDGET_S}s budget"
        STATUS[$name]="FAILED (no time left)"
        FAILED=1
        return 0
    fi
    local log=$LOG_DIR/$name.log t0 rc=0
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$log" || rc=$?
    local took=$(($(date +%s) - t0))
    if ((rc == 124 || rc == 137)); then
        STATUS[$name]="FAILED (timed out after ${took}s)"
        FAILED=1
    elif ((rc != 0)); then
        STATUS[$name]="FAILED (exit $rc, ${took}s)"
        FAILED=1
    else
        STATUS[$name]="ok (${took}s)"
    fi
    # The JSON is kept also from a run that failed after printing it (a variant or run that
    # raised is listed under "errors" there); a phase that exits 0 without it failed.
    if [[ -n $result ]]; then
        if save_result "$log" "$result"; then
            if ((rc != 0)); then STATUS[$name]+=" (its JSON saved)"; fi
        elif ((rc == 0)); then
            STATUS[$name]="FAILED (no JSON on the last line, ${took}s)"
            FAILED=1
        fi
    fi
    export_out
    return 0
}

# The phases' status, one line each (printed at the end, and exported).
phase_table() {
    local p
    for p in "${PHASES[@]}" cuda; do
        if [[ -n ${STATUS[$p]:-} ]]; then printf '   %-10s %s
' "$p" "${STATUS[$p]}"; fi
    done
}

# Copy what there is so far to $OUT (flat: the results' JSON, the phases, the summary table and
# one archive of every log), so that a run cut short still leaves its finished phases there.
export_out() {
    [[ -n $OUT ]] || return 0
    mkdir -p "$OUT"
    phase_table >"$LOG_DIR/phases.txt"
    cp "$LOG_DIR/phases.txt" "$OUT/phases.txt"
    local f
    for f in "$RESULTS_OUT"/*.json; do
        if [[ -f $f ]]; then cp "$f" "$OUT/"; fi
    done
    if [[ -s $LOG_DIR/summary.log ]]; then
        sed '$d' "$LOG_DIR/summary.log" >"$OUT/gpu_summary.txt"
    fi
    tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$LOG_DIR" . 2>/dev/null || true
}

# save_result LOG NAME: the last line of LOG, checked to be one JSON object, as NAME_<gpu>.json
# in $RESULTS_OUT and (not in a rehearsal) bench/results.
save_result() {
    local log=$1 name=$2 line
    line=$(tail -n 1 "$log")
    "$PY" -c 'import json, sys; assert isinstance(json.loads(sys.argv[1]), dict)' "$line" \
        2>/dev/null || return 1
    printf '%s\n' "$line" >"$RESULTS_OUT/${name}_${TAG}.json"
    if ((!REHEARSAL)); then printf '%s\n' "$line" >"bench/results/${name}_${TAG}.json"; fi
    echo "   saved ${name}_${TAG}.json"
}

# -- run --------------------------------------------------------------------------------------
MODE=""
if ((DRY_RUN)); then MODE+=" (dry run)"; fi
if ((REHEARSAL)); then MODE+=" (CPU rehearsal)"; fi
echo "== asteria bench/gpu_check.sh$MODE"
PY_NOTE=""
if ((DRY_RUN)) && [[ -z ${PYTHON:-} ]]; then PY_NOTE=" (first found; a run checks for CUDA)"; fi
echo "   python: $PY$PY_NOTE; logs: $LOG_DIR; budget: ${BUDGET_S}s; workers: $WORKERS"
echo "   model: $MODEL, $LAYERS layers, batch $BATCH x $SEQ, $STEPS steps; device: $DEVICE"
if ((!DRY_RUN)); then
    rm -rf "$LOG_DIR" # this run's logs and results only
    mkdir -p "$LOG_DIR" "$RESULTS_OUT" bench/results
fi
if [[ -n $OUT ]]; then echo "   copies to: \$OUT=$OUT"; fi

# The GPU machine's torch (2.11 on the H200) may lie outside the supported range that setup.py
# enforces (Note [Supported torch] in asteria/_supported.py): this check builds against whatever
# torch is installed, so it says so (setup.py warns) instead of stopping at the build.
run_phase build -- env ASTERIA_FORCE_CUDA=1 \
    TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" MAX_JOBS="$MAX_JOBS" "$PY" -m pip install --disable-pip-version-check -v --no-build-isolation \
    --no-deps -e .

run_phase info -- "$PY" -m asteria.info
if ((!DRY_RUN && !REHEARSAL)); then
    GPU_NAME=$("$PY" -c 'import torch
if torch.cuda.is_available(): print(torch.cuda.get_device_name())' 2>/dev/null || true)
    if [[ -z $GPU_NAME ]]; then
        echo "   torch sees no CUDA device: the GPU phases will fail"
        STATUS[cuda]="FAILED (torch sees no CUDA device)"
        FAILED=1
        TAG=nocuda
    else
        TAG=$("$PY" -c 'import sys
from bench._common import device_tag
print(device_tag(sys.argv[1]))' "$GPU_NAME")
        echo "   GPU: $GPU_NAME -> results *_${TAG}.json"
    fi
fi

# One pytest per file (tools/pytest_each.sh): a test that crashes the interpreter costs its own
# file's report, not the others'.
run_phase tests -- tools/pytest_each.sh "$PY" tests/gpu/test_*.py "${UNIT_TESTS[@]}"

# Where the host time of a step goes (issue 24: Asteria's tiny step on the H200 was 35-40 ms
# longer than native's): native and Asteria SOAP and Shampoo, and Asteria with one part of the
# runtime off at a time (the bases window, the module hooks, the device stream).
if ((REHEARSAL)); then
    PROFILE_ARGS=(--model nano --steps 4 --skip 2 --profile-steps 2)
else # about 75 s on the H200 host for four variants at these lengths
    PROFILE_ARGS=(--model tiny --steps 20 --skip 10 --profile-steps 5 --variants
        soap_native,soap_asteria,soap_asteria+bases_device,soap_asteria+pool,shampoo_asteria)
fi
run_phase profile profile_step -- "$PY" bench/profile_step.py --device "$DEVICE" \
    "${PROFILE_ARGS[@]}" --workers "$WORKERS" --keep-going

# The host's work per step, counted (issue 37): ATen ops, syncs and Python calls of the step and
# of the runtime's signals, native against Asteria's window and device bases, at 1x and 2x the
# tiny preset's layers (bench/host_overhead.py; on the CPU it forces the GPU strategies).
if ((REHEARSAL)); then HOST_ARGS=(--model nano --scales 1 --steps 4); else
    HOST_ARGS=(--model tiny --scales 1,2 --steps 14); fi
run_phase host_overhead host_overhead -- "$PY" bench/host_overhead.py --device "$DEVICE" \
    "${HOST_ARGS[@]}" --workers "$WORKERS"

run_phase step_time step_time -- "$PY" bench/step_time.py --device "$DEVICE" --model "$MODEL" \
    --layers "$LAYERS" --batch-size "$BATCH" --seq-len "$SEQ" --steps "$STEPS" --skip "$SKIP" \
    --workers "$WORKERS" --variants "$VARIANTS" --energy --keep-going

# Time to AdamW's loss on the device (issue 24): the tiny preset, every variant, seeds 1-3, at
# the rates the committed CPU run tuned (--rates-from: the same optimizers and model; the device
# trains in bf16 autocast), the runtime's workers on the host's cores. The plot stays with the
# logs (the device tool brings back at most 8 files).
if ((REHEARSAL)); then TTT_ARGS=(--quick); else TTT_ARGS=(--presets "${GPU_CHECK_TTT_PRESETS:-tiny}"); fi
run_phase time_to_target time_to_target -- "$PY" bench/time_to_target.py --device "$DEVICE" \
    "${TTT_ARGS[@]}" --rates-from bench/results/time_to_target_cpu.json ${GPU_CHECK_TTT_ARGS:-} \
    --plots "$LOG_DIR/plots" --cache "$LOG_DIR/time_to_target_runs.jsonl"

run_phase memory memory -- "$PY" bench/memory.py --measure-cuda --model "$MODEL" \
    --layers "$LAYERS" --batch-size "$((BATCH < 8 ? BATCH : 8))" --seq-len "$SEQ" \
    --measure-steps "$MEM_STEPS" --workers "$WORKERS"

if [[ -f bench/capacity.py ]]; then
    CAPACITY=capacity
    # shellcheck disable=SC2086  # GPU_CHECK_CAPACITY_ARGS is a list of words
    run_phase capacity capacity -- "$PY" bench/capacity.py ${GPU_CHECK_CAPACITY_ARGS:-}
else
    CAPACITY=gpu_refresh_time
    capacity_budget=$(($(phase_limit capacity) - 20)) # its own, inside the phase's timeout
    capacity_budget=$((capacity_budget > 10 ? capacity_budget : 10))
    run_phase capacity gpu_refresh_time -- "$PY" bench/gpu_refresh_time.py --device "$DEVICE" \
        --sizes "$SIZES" --workers "$WORKERS" --budget-s "$capacity_budget"
fi

# A result this run did not make (a phase not selected, e.g. in a rerun with --only) is taken
# from bench/results where an earlier run left it (not in a rehearsal).
result_path() {
    local f=${1}_${TAG}.json
    if ((!REHEARSAL && !DRY_RUN)) && [[ ! -f $RESULTS_OUT/$f && -f bench/results/$f ]]; then
        echo "bench/results/$f"
    else
        echo "$RESULTS_OUT/$f"
    fi
}
run_phase summary gpu_summary -- "$PY" bench/gpu_summary.py \
    --step-time "$(result_path step_time)" --memory "$(result_path memory)" \
    --capacity "$(result_path "$CAPACITY")" --time-to-target "$(result_path time_to_target)" \
    --device-name "$GPU_NAME"

# -- phases ------------------------------------------------------------------------------------
echo
echo "== phases ($(($(date +%s) - START))s of the ${BUDGET_S}s budget)"
phase_table
if ((DRY_RUN)); then exit 0; fi
export_out
echo "   logs and results: $LOG_DIR${OUT:+ (copied to $OUT)}"
if [[ -s $LOG_DIR/summary.log ]]; then # the goals table again, last (without its JSON line)
    echo
    sed '$d' "$LOG_DIR/summary.log"
fi
if ((FAILED)); then echo "gpu_check.sh: some phases failed (see above)"; fi
exit "$FAILED"
