#!/usr/bin/env bash
# The CUDA path on a real GPU, in stages of at most 8 minutes each (a lent GPU gives about 13
# minutes in all, at most 10 a command, and at most 8 files back a command).
#
#   bench/gpu_check.sh --stage 1        build, asteria.info, tests/gpu (the window forced, the
#                                       snapshot race, the window through the runtime)
#   bench/gpu_check.sh --stage 2        step time: tiny and OLMo-150m, AdamW and SOAP, KL-Shampoo
#                                       and Shampoo x {native, bases on the device, window}
#   bench/gpu_check.sh --stage 3        per-step launches, syncs and pinned registrations
#                                       (profiler, tiny); device memory with the window (OLMo-150m)
#   bench/gpu_check.sh --stage 4        the peers on the GPU (bench/optim_step.py --device cuda),
#                                       then issue 49's short time to target (tiny)
#   bench/gpu_check.sh                  every stage, in order (a machine with the time for it)
#   bench/gpu_check.sh --dry-run        print every phase's command and time box, run nothing
#   bench/gpu_check.sh --cpu-rehearsal  the same phases on CPU with tiny sizes (no build; results
#                                       stay in the log directory, never in bench/results)
#   bench/gpu_check.sh --only step_tiny,summary   run only the named phases
#   bench/gpu_check.sh --skip-build     every selected phase but the build
#
# Each stage begins with the build (incremental where build/ survived: seconds) and ends with
# the summary. Each phase runs under `timeout` with its box (BOX_S), cut so that the stage's
# later phases keep their minimum within the stage's limit (STAGE_LIMIT_S, 470 s; the boxes of
# each stage add up to at most that: tests/unit/test_gpu_check.py checks it, and that each box
# covers the phase's measured need, NEED_S). A failing phase does not stop later ones; the exit
# code is 1 if any phase failed (0 otherwise; a missed goal is not a failure).
# Every benchmark writes its JSON as it goes ($BENCH_PARTIAL_JSON, after each variant): a phase
# cut by its box keeps what it measured (marked "partial"). Results: bench/results/<bench>_<gpu>
# .json (<gpu> from torch.cuda.get_device_name: "NVIDIA H200" -> h200). Logs and results are
# written under build/gpu_check/; when $OUT is set, after every phase it receives exactly two
# files: gpu_check_stage<N>.tar.gz (every log, every result JSON, phases.txt, commit.txt) and
# gpu_check_stage<N>.txt (the commit, the phases' status, the goals table). Every JSON records
# the commit (ASTERIA_COMMIT, else git; pass ASTERIA_COMMIT=$(git rev-parse HEAD) where the
# tree travels without fresh git metadata).
# Knobs (environment): PYTHON, STAGE_LIMIT_S, GPU_CHECK_WORKERS (cores - 1), GPU_CHECK_PEERS
# (a folder of peer wheels and Meta's distributed_shampoo, default build/peers, made by
# tools/pack_peers.sh), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS, ASTERIA_COMMIT.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
REHEARSAL=0
ONLY=""
SKIP_BUILD=0
STAGE=""
while (($#)); do
    case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --cpu-rehearsal) REHEARSAL=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    --stage)
        [[ $# -ge 2 ]] || { echo "gpu_check.sh: --stage needs a number (1-4)" >&2; exit 2; }
        STAGE=$2
        shift
        ;;
    --stage=*) STAGE=${1#--stage=} ;;
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

# The stages, in the order a verdict needs them; a phase name is unique across stages, but
# build and summary open and close every stage.
declare -A STAGE_PHASES=(
    [1]="build info tests summary"
    [2]="build step_tiny step_olmo summary"
    [3]="build profile memory summary"
    [4]="build peers ttt summary"
)
STAGES=(1 2 3 4)
if [[ -n $STAGE && -z ${STAGE_PHASES[$STAGE]:-} ]]; then
    echo "gpu_check.sh: unknown stage '$STAGE' (stages: ${STAGES[*]})" >&2
    exit 2
fi
ALL_PHASES=(build info tests step_tiny step_olmo profile memory peers ttt summary)
if [[ -n $ONLY ]]; then
    IFS=, read -r -a wanted <<<"$ONLY"
    for w in "${wanted[@]}"; do
        if [[ " ${ALL_PHASES[*]} " != *" $w "* ]]; then
            echo "gpu_check.sh: unknown phase '$w' (phases: ${ALL_PHASES[*]})" >&2
            exit 2
        fi
    done
fi

# -- time boxes --------------------------------------------------------------------------------
# NEED_S: what each phase needs on an H100/H200 host (16 cores), from docs/gpu.md's runs and the
# CPU rehearsal with the GPU strategies forced (docs/gpu.md, "Stages"); BOX_S >= NEED_S, and a
# stage's boxes add up to at most STAGE_LIMIT_S. MIN_S: what a phase keeps when earlier ones ran
# long.
STAGE_LIMIT_S=${STAGE_LIMIT_S:-470}
declare -A NEED_S=([build]=45 [info]=10 [tests]=250 [step_tiny]=80 [step_olmo]=230 [profile]=150
    [memory]=120 [peers]=170 [ttt]=130 [summary]=5)
declare -A BOX_S=([build]=100 [info]=30 [tests]=320 [step_tiny]=100 [step_olmo]=250
    [profile]=200 [memory]=150 [peers]=190 [ttt]=160 [summary]=20)
declare -A MIN_S=([build]=60 [info]=15 [tests]=120 [step_tiny]=60 [step_olmo]=150 [profile]=90
    [memory]=60 [peers]=90 [ttt]=60 [summary]=15)

# -- settings ---------------------------------------------------------------------------------
CORES=$(nproc 2>/dev/null || echo 2)
WORKERS=${GPU_CHECK_WORKERS:-$((CORES > 1 ? CORES - 1 : 1))}
if ((REHEARSAL)); then
    DEVICE=cpu STEPS=16 SKIP=4 MEM_STEPS=2 WORKERS=1
    TINY=(--model nano --layers 1 --batch-size 4 --seq-len 32)
    OLMO=(--model nano --layers 2 --batch-size 4 --seq-len 64)
    MEM=(--model nano --layers 1 --batch-size 4 --seq-len 32)
    STAGE_LIMIT_S=${GPU_CHECK_REHEARSAL_LIMIT_S:-1800} # the 2-core CPU is far slower
else
    DEVICE=cuda STEPS=30 SKIP=10 MEM_STEPS=16
    TINY=(--model tiny --batch-size 8 --seq-len 128)
    OLMO=(--model olmo-150m --layers 12 --batch-size 32 --seq-len 512)
    MEM=(--model olmo-150m --layers 12 --batch-size 8 --seq-len 512)
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$CORES}
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 # a crash prints every thread's Python stack into the phase's log
# native, the bases on the device and the bases behind the window, in the same run
VARIANTS=adamw
for opt in soap kl_shampoo shampoo; do VARIANTS+=",${opt}_native,${opt}_device,${opt}_window"; done
PROFILE_VARIANTS=soap_native,soap_asteria+bases_device,soap_asteria+window
PROFILE_VARIANTS+=,kl_shampoo_native,kl_shampoo_asteria+window,shampoo_native,shampoo_asteria+window
PEERS=${GPU_CHECK_PEERS:-build/peers}
# ours and the peers' SOAP first, heavyball (torch.compile'd on CUDA: the slowest to start) last;
# each finished optimizer is in the partial JSON
PEER_ORDER=torch_adamw,asteria_soap,pytorch_optimizer_soap,meta_soap,asteria_shampoo,meta_shampoo
PEER_ORDER+=,asteria_kl_shampoo,meta_kl_shampoo,heavyball_soap,heavyball_kl_shampoo
# issue 49's short time to target (bench/time_to_target.py --variants/--seeds)
TTT_VARIANTS=adamw,muon,soap-f1:native,soap:continuous

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
if [[ -z ${ASTERIA_COMMIT:-} ]]; then
    ASTERIA_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    if [[ $ASTERIA_COMMIT != unknown ]] && [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
        ASTERIA_COMMIT+="+dirty"
    fi
fi
export ASTERIA_COMMIT # every bench's JSON records it (bench/_common.recorded)
if [[ -n $STAGE ]]; then
    PHASES=(${STAGE_PHASES[$STAGE]})
    STAGE_NAME=stage$STAGE
else
    PHASES=("${ALL_PHASES[@]}")
    STAGE_NAME=all
fi
declare -A STATUS=()
FAILED=0
START=$(date +%s)
STAGE_START=$START
STAGE_OF_PHASE=""

selected() {
    local p=$1
    if [[ $p == build ]] && ((REHEARSAL)); then return 1; fi # never rebuild the CPU extension
    if [[ -n $ONLY ]]; then [[ ",$ONLY," == *",$p,"* ]]; return; fi
    if [[ $p == build ]] && ((SKIP_BUILD)); then return 1; fi
    return 0
}

# The limit of phase $1: its box, cut so that every selected phase after it in its stage keeps
# its minimum within the stage's limit.
phase_limit() {
    local name=$1 later=0 seen=0 p
    for p in ${STAGE_OF_PHASE:-${PHASES[*]}}; do
        if ((seen)) && selected "$p"; then later=$((later + MIN_S[$p])); fi
        [[ $p == "$name" ]] && seen=1
    done
    local left=$((STAGE_LIMIT_S - ($(date +%s) - STAGE_START) - later))
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
# is given, the log's last line (the benchmark's JSON) is saved as RESULT_<gpu>.json, else the
# JSON the bench wrote as it went ($BENCH_PARTIAL_JSON), marked partial.
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
    echo "== phase $name (timeout ${limit}s, box ${BOX_S[$name]}s, need ${NEED_S[$name]}s): $(quote "$@")"
    [[ -n $result ]] && echo "   result: bench/results/${result}_${TAG}.json"
    if ((DRY_RUN)); then
        STATUS[$name]="dry run"
        return 0
    fi
    if ((limit < 10)); then
        echo "   not run: ${limit}s left of the stage's ${STAGE_LIMIT_S}s"
        STATUS[$name]="FAILED (no time left)"
        FAILED=1
        export_out
        return 0
    fi
    local log=$LOG_DIR/$name.log t0 rc=0 partial=$LOG_DIR/$name.partial.json
    rm -f "$partial"
    t0=$(date +%s)
    BENCH_PARTIAL_JSON=$partial timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 |
        tee "$log" || rc=$?
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
    # raised is listed under "errors" there), or from what the bench wrote as it went.
    if [[ -n $result ]]; then
        if save_result "$log" "$result"; then
            if ((rc != 0)); then STATUS[$name]+=" (its JSON saved)"; fi
        elif [[ -s $partial ]] && save_partial "$partial" "$result"; then
            STATUS[$name]+=" (partial JSON saved)"
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
        if [[ -n ${STATUS[$p]:-} ]]; then printf '   %-10s %s\n' "$p" "${STATUS[$p]}"; fi
    done
}

# Copy what there is so far to $OUT as two files (the device tool brings back at most 8): one
# archive (every log, the results' JSON, phases.txt, commit.txt) and one summary (the commit,
# the phases, the goals table), so that a run cut short still leaves its finished phases there.
export_out() {
    [[ -n $OUT ]] || return 0
    mkdir -p "$OUT"
    phase_table >"$LOG_DIR/phases.txt"
    echo "$ASTERIA_COMMIT" >"$LOG_DIR/commit.txt"
    {
        echo "asteria bench/gpu_check.sh $STAGE_NAME at $ASTERIA_COMMIT on $GPU_NAME"
        echo "($(($(date +%s) - START))s since the start; stage limit ${STAGE_LIMIT_S}s)"
        cat "$LOG_DIR/phases.txt"
        if [[ -s $LOG_DIR/summary.log ]]; then
            echo
            sed '$d' "$LOG_DIR/summary.log"
        fi
    } >"$OUT/gpu_check_$STAGE_NAME.txt"
    tar -czf "$OUT/gpu_check_$STAGE_NAME.tar.gz" -C "$LOG_DIR" . 2>/dev/null || true
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

# save_partial FILE NAME: what a bench cut by its box wrote as it went, as NAME_<gpu>.json.
save_partial() {
    local file=$1 name=$2
    "$PY" -c 'import json, sys; assert json.load(open(sys.argv[1]))["partial"]' "$file" \
        2>/dev/null || return 1
    cp "$file" "$RESULTS_OUT/${name}_${TAG}.json"
    if ((!REHEARSAL)); then cp "$file" "bench/results/${name}_${TAG}.json"; fi
    echo "   saved ${name}_${TAG}.json (partial: the phase was cut)"
}

# A result this run did not make (another stage's) is taken from bench/results where an earlier
# run left it (not in a rehearsal).
result_path() {
    local f=${1}_${TAG}.json
    if ((!REHEARSAL && !DRY_RUN)) && [[ ! -f $RESULTS_OUT/$f && -f bench/results/$f ]]; then
        echo "bench/results/$f"
    else
        echo "$RESULTS_OUT/$f"
    fi
}

# -- the phases -------------------------------------------------------------------------------
phase_build() {
    run_phase build -- env ASTERIA_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
        MAX_JOBS="$MAX_JOBS" "$PY" -m pip install --disable-pip-version-check -v \
        --no-build-isolation --no-deps -e .
}

phase_info() {
    run_phase info -- "$PY" -m asteria.info
}

gpu_name() { # after the build: the device's name and the results' tag
    if ((DRY_RUN || REHEARSAL)) || [[ $TAG != "<gpu>" ]]; then return 0; fi
    GPU_NAME=$("$PY" -c 'import torch
if torch.cuda.is_available(): print(torch.cuda.get_device_name())' 2>/dev/null || true)
    if [[ -z $GPU_NAME ]]; then
        echo "   torch sees no CUDA device: the GPU phases will fail"
        STATUS[cuda]="FAILED (torch sees no CUDA device)"
        FAILED=1
        TAG=nocuda GPU_NAME=none
    else
        TAG=$("$PY" -c 'import sys
from bench._common import device_tag
print(device_tag(sys.argv[1]))' "$GPU_NAME")
        echo "   GPU: $GPU_NAME -> results *_${TAG}.json"
    fi
}

# One pytest per file (tools/pytest_each.sh): a test that crashes the interpreter costs its own
# file's report. tests/gpu: the build, the public API, pinned memory, the device stream, and the
# window (forced: placement={"bases": "host"}) with the snapshot race and the window through the
# runtime for all three optimizers against the bases on the device. In a rehearsal (they skip
# without CUDA) the window's CPU tests instead.
phase_tests() {
    local files=(tests/gpu/test_window_gpu.py) f # the window and the race first
    for f in tests/gpu/test_*.py; do
        if [[ $f != tests/gpu/test_window_gpu.py ]]; then files+=("$f"); fi
    done
    if ((REHEARSAL)); then files=(tests/unit/test_window.py); fi
    run_phase tests -- tools/pytest_each.sh "$PY" "${files[@]}"
}

# Step time, median, p95, max and the optimizer's own ms: AdamW, and SOAP, KL-Shampoo and
# Shampoo natively, with the bases on the device, and behind the window, in the same run.
phase_step_tiny() {
    run_phase step_tiny step_time_tiny -- "$PY" bench/step_time.py --device "$DEVICE" \
        "${TINY[@]}" --steps "$STEPS" --skip "$SKIP" --workers "$WORKERS" --variants "$VARIANTS" \
        --keep-going
}
phase_step_olmo() {
    run_phase step_olmo step_time -- "$PY" bench/step_time.py --device "$DEVICE" "${OLMO[@]}" \
        --steps "$STEPS" --skip "$((SKIP - 2))" --workers "$WORKERS" --variants "$VARIANTS" \
        --energy --keep-going
}

# Per step at tiny, from torch.profiler: kernel launches, host waits (syncs) and pinned
# registrations, native against the bases on the device and behind the window.
phase_profile() {
    local args=(--model tiny --steps 15 --skip 8 --profile-steps 4)
    if ((REHEARSAL)); then args=(--model nano --steps 4 --skip 2 --profile-steps 2); fi
    run_phase profile profile_step -- "$PY" bench/profile_step.py --device "$DEVICE" \
        "${args[@]}" --variants "$PROFILE_VARIANTS" --workers "$WORKERS" --keep-going
}

# Device memory (max_memory_allocated) at OLMo-150m: no optimizer, native, the window forced and
# auto placement, SOAP and KL-Shampoo.
phase_memory() {
    run_phase memory memory -- "$PY" bench/memory.py --measure-cuda "${MEM[@]}" \
        --measure-steps "$MEM_STEPS" --workers "$WORKERS"
}

# The peers on the GPU: heavyball, pytorch-optimizer (wheels) and Meta's Distributed Shampoo
# (its package) travel with the tree under $PEERS (tools/pack_peers.sh; the device call carries
# that folder); installed here without the network, then bench/optim_step.py --device cuda.
phase_peers() {
    local install="" meta=$PEERS/meta_distributed_shampoo
    [[ $meta == /* ]] || meta=$ROOT/$meta
    if compgen -G "$PEERS/*.whl" >/dev/null || ((DRY_RUN)); then
        install="$PY -m pip install --disable-pip-version-check --no-index --no-deps -q $PEERS/*.whl && "
    fi
    run_phase peers optim_step -- env ASTERIA_META_SHAMPOO="$meta" \
        bash -c "${install}exec $PY bench/optim_step.py --device $DEVICE --sequential --steps 30 --warmup 3 --only $PEER_ORDER"
}

# ==== issue 49's short time to target (bench/time_to_target.py: --variants, --seeds) ===========
# Kept as its own phase for the engineer who owns that bench: tiny, two seeds, AdamW, Muon, SOAP
# refreshed every step natively and SOAP continuous under the runtime; each finished run goes to
# the cache as it ends (a cut phase keeps them).
phase_ttt() {
    local args=(--presets tiny --variants "$TTT_VARIANTS" --seeds 1,2)
    if ((REHEARSAL)); then args=(--quick --variants "$TTT_VARIANTS" --seeds 1,2); fi
    run_phase ttt time_to_target -- "$PY" bench/time_to_target.py --device "$DEVICE" "${args[@]}" \
        --rates-from bench/results/time_to_target_cpu.json --tune-missing \
        --plots "$LOG_DIR/plots" --cache "$LOG_DIR/time_to_target_runs.jsonl"
}

phase_summary() {
    run_phase summary gpu_summary -- "$PY" bench/gpu_summary.py \
        --step-time "$(result_path step_time)" --memory "$(result_path memory)" \
        --capacity "$(result_path capacity)" --time-to-target "$(result_path time_to_target)" \
        --device-name "$GPU_NAME"
}

# -- run --------------------------------------------------------------------------------------
MODE=""
if ((DRY_RUN)); then MODE+=" (dry run)"; fi
if ((REHEARSAL)); then MODE+=" (CPU rehearsal)"; fi
echo "== asteria bench/gpu_check.sh $STAGE_NAME$MODE at $ASTERIA_COMMIT"
PY_NOTE=""
if ((DRY_RUN)) && [[ -z ${PYTHON:-} ]]; then PY_NOTE=" (first found; a run checks for CUDA)"; fi
echo "   python: $PY$PY_NOTE; logs: $LOG_DIR; stage limit: ${STAGE_LIMIT_S}s; workers: $WORKERS"
if ((!DRY_RUN)); then
    rm -rf "$LOG_DIR" # this run's logs and results only
    mkdir -p "$LOG_DIR" "$RESULTS_OUT" bench/results
fi
if [[ -n $OUT ]]; then echo "   copies to: \$OUT=$OUT (gpu_check_$STAGE_NAME.tar.gz and .txt)"; fi

for st in "${STAGES[@]}"; do
    if [[ -n $STAGE && $st != "$STAGE" ]]; then continue; fi
    STAGE_OF_PHASE=${STAGE_PHASES[$st]}
    STAGE_START=$(date +%s)
    echo "== stage $st: $STAGE_OF_PHASE (limit ${STAGE_LIMIT_S}s)"
    for phase in $STAGE_OF_PHASE; do
        if [[ -z $STAGE && $phase == build && $st != "${STAGES[0]}" ]]; then
            continue # one build for a run of every stage ...
        fi
        if [[ -z $STAGE && $phase == summary && $st != "${STAGES[-1]}" ]]; then
            continue # ... and one summary
        fi
        if [[ $phase != build ]]; then gpu_name; fi # (once: after the build, if any)
        "phase_$phase"
    done
done

# -- phases ------------------------------------------------------------------------------------
echo
echo "== phases ($(($(date +%s) - START))s)"
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
