#!/usr/bin/env bash
# The test suite against another torch (Note [Supported torch] in asteria/_supported.py).
#
#   tools/test_torch.sh VENV [PYTEST ARGS...]
#
# VENV has that torch and requirements-test.txt installed (make test-torch-cuda sets up
# .venv-cuda, with the CUDA 2.14.1 wheel). The checkout's own extension belongs to .venv's torch,
# so this builds the CPU extension against VENV's torch in a copy of the working tree,
# build/torch-<version>/tree (tracked and untracked files, not ignored ones; gitignored), and runs
# pytest there. The copy keeps its object files between runs, so ninja recompiles only what
# changed. Prints the build's and the tests' wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: tools/test_torch.sh VENV [PYTEST ARGS...]}"
shift
py="$(cd "$venv" && pwd)/bin/python"
version="$("$py" -c 'import torch; print(torch.__version__)')"
tree="build/torch-${version}/tree"
mkdir -p "$tree"
# the working tree's files as they are now (tar keeps their times, so ninja's objects under the
# copy's build/ stay valid); whatever else the copy held goes
find "$tree" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  if [[ -e "$f" ]]; then printf '%s\0' "$f"; fi
done | tar --null -T - -cf - | tar -xf - -C "$tree"
start=$SECONDS
(cd "$tree" && ASTERIA_NO_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" "$py" setup.py -q build_ext --inplace)
echo "test_torch.sh: built asteria._C against torch ${version} in $((SECONDS - start)) s"
start=$SECONDS
status=0
(cd "$tree" && "$py" -m pytest -q "$@") || status=$?
echo "test_torch.sh: pytest against torch ${version}: $((SECONDS - start)) s, exit ${status}"
exit "$status"
