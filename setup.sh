#!/usr/bin/env bash
# Creates .venv beside this file and installs Kestrel's dependencies and then Kestrel itself
# (editable) into it. Idempotent: a second run only checks (and refreshes the install).
# KESTREL_DEV=1 also installs the test tools.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv"
    "$PY" -m venv .venv
fi
# pip's own output is the progress: each package as it is collected, downloads with a bar.
# (With -q it printed nothing for minutes on a small CPU.)
PIP=(.venv/bin/python -m pip install --disable-pip-version-check --progress-bar on)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "installing torch (CUDA build) and triton"
        # With the engine's requirements, so that pip picks a torch whose triton fits them.
        "${PIP[@]}" "torch>=2.6" -r requirements-engine.txt
    else
        # No GPU: the CPU path and the Triton interpreter. 2.13.0 is the release CI uses.
        echo "installing torch 2.13.0 and triton 3.6.0 (no NVIDIA GPU found: CPU mode)"
        "${PIP[@]}" "torch==2.13.0" "triton==3.6.0"
    fi
fi
echo "installing requirements.txt (transformers, gradio, ...): a few minutes on a small CPU"
"${PIP[@]}" -r requirements.txt
if [ "${KESTREL_DEV:-0}" = "1" ]; then
    echo "installing requirements-dev.txt (pytest, ruff, playwright, ...)"
    "${PIP[@]}" -r requirements-dev.txt
fi
# The checkout itself, editable: its root on .venv's path and the console scripts
# (kestrel, kestrel-ui, kestrel-api, kestrel-convert, kestrel-tgw) in .venv/bin. Nothing is
# compiled; --no-deps: the requirements files above are the dependencies.
echo "installing the checkout (pip install -e .)"
"${PIP[@]}" --no-deps -e .
.venv/bin/python -c "import torch, triton; print(f'ready: torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.cuda.is_available()}')"
