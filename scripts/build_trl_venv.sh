#!/usr/bin/env bash
# Build a venv of its own with TRL, for benchmarks/time_to_accuracy.py's TRL leg (TRL's
# GRPOTrainer, what a user would pick instead of this project, run beside our demo).
# Usage: scripts/build_trl_venv.sh [VENV_DIR]   (default .venv-trl)
# Versions: TRL 1.16 (the release the issue measured), transformers as our lock pins it,
# CPU torch first (PyPI's torch is the CUDA build on Linux). A venv apart so that TRL's
# dependency pins never move the project's lock.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-trl}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
transformers=$(grep -E '^transformers==' constraints.txt)
"$venv/bin/pip" install -q "trl==1.16.*" "$transformers" gguf matplotlib  # matplotlib: the PNG
"$venv/bin/python" -c "import trl, transformers; print('trl', trl.__version__, 'transformers', transformers.__version__)"
