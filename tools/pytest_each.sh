#!/usr/bin/env bash
# Run pytest once per test file (or node id) given, so that a file whose test crashes the
# interpreter (a segfault in the extension) does not hide the results of the others; each run
# reports its failures (-rfE, short tracebacks) and, on a crash, every thread's Python stack
# (PYTHONFAULTHANDLER). Prints one status line per file at the end; exits non-zero when any run
# did. Used by bench/gpu_check.sh's tests phase.
#   tools/pytest_each.sh PYTHON FILE... [-- PYTEST_ARGS...]
set -uo pipefail
py=$1
shift
files=()
while (($#)) && [[ $1 != -- ]]; do files+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
export PYTHONFAULTHANDLER=1
rc=0
summary=()
for f in "${files[@]}"; do
    echo "== pytest $f"
    "$py" -m pytest -q -rfEs --tb=short -p no:cacheprovider "$@" "$f"
    r=$?
    case $r in
    0 | 5) summary+=("ok        $f") ;; # 5: every test deselected or skipped away
    1) summary+=("FAILED    $f"); rc=1 ;;
    *) summary+=("EXIT $r   $f$( ((r > 128)) && echo " (signal $((r - 128)))")"); rc=1 ;;
    esac
done
echo "== pytest_each: per file"
printf '   %s\n' "${summary[@]}"
exit "$rc"
