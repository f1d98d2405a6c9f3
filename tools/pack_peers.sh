#!/usr/bin/env bash
# Pack the peers bench/optim_step.py compares against, to travel with the tree to a GPU machine
# (which reaches no package index): heavyball and pytorch-optimizer as wheels of the versions
# installed in the venv, with opt-einsum (heavyball's one dependency beyond torch and numpy), and
# Meta's Distributed Shampoo (not on any index) as its package folder from ../shared/peers.
#   tools/pack_peers.sh [DEST]     (default build/peers; gitignored: the device call carries it)
# bench/gpu_check.sh --stage 4 installs the wheels there with --no-index and points
# bench/optim_step.py at the Meta copy (ASTERIA_META_SHAMPOO).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-build/peers}
PY=${PYTHON:-.venv/bin/python}
META=${META_SHAMPOO:-../shared/peers/meta_distributed_shampoo}
rm -rf "$DEST"
mkdir -p "$DEST"
pins=()
for pkg in heavyball pytorch-optimizer opt-einsum; do
    v=$("$PY" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$pkg")
    pins+=("$pkg==$v")
done
"$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: -q -d "$DEST" "${pins[@]}"
if [[ -d $META/distributed_shampoo ]]; then
    mkdir -p "$DEST/meta_distributed_shampoo"
    cp -r "$META/distributed_shampoo" "$META/LICENSE" "$DEST/meta_distributed_shampoo/"
    find "$DEST/meta_distributed_shampoo" -name __pycache__ -prune -exec rm -rf {} +
else
    echo "pack_peers.sh: no Meta Distributed Shampoo at $META: its rows will be left out" >&2
fi
du -sh "$DEST"
ls "$DEST"
