#!/usr/bin/env bash
# Compile-only check of the CUDA build of asteria._C, for machines without a GPU.
#
# Run from anywhere with a CUDA torch environment already activated (here: .venv-cuda) and nvcc
# on PATH or CUDA_HOME set. It builds into build-cuda/ (gitignored) and never touches the CPU
# extension that lives next to the sources. Nothing is installed. Override the target GPU with
# TORCH_CUDA_ARCH_LIST (default 9.0, the H200) and parallelism with MAX_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import sys, torch; sys.exit(0 if torch.version.cuda else "activate a CUDA torch first")'
export ASTERIA_FORCE_CUDA=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
start=$(date +%s)
python setup.py build_ext --build-temp build-cuda/tmp --build-lib build-cuda/lib
echo "compile_cuda.sh: built $(ls build-cuda/lib/asteria/_C*.so) in $(($(date +%s) - start)) s"
