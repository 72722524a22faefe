#!/usr/bin/env bash
# Creates .venv (once) with SGLang 0.5.17 and freetoken-sglang installed, then exits.
# On a machine with an NVIDIA GPU: SGLang with its own pinned dependencies (torch 2.11).
# Without one (dev and CI machines): the CPU recipe of the README ("Running on the CPU") - torch 2.14.1
# and torchvision 0.29.1 (from the machine's local package store), SGLang without its CUDA
# dependencies, and its pure-Python dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FREETOKEN_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.freetoken-env-ok"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt .ci/setup-env.sh ]; then
  # Environment already built; only (re)build the package itself (C executor included).
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade setuptools wheel cffi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PIP" install -q "sglang==0.5.17"
else
  "$PIP" install -q torch==2.14.1 torchvision==0.29.1
  "$PIP" install -q --no-deps sglang==0.5.17
  "$PIP" install -q tokenizers safetensors huggingface_hub numpy scipy fastapi uvicorn uvloop \
    pydantic 'pyzmq>=25.1.2' orjson msgspec aiohttp requests psutil setproctitle pybase64 \
    python-multipart partial_json_parser 'prometheus-client>=0.20.0' xxhash einops interegular \
    pillow tqdm packaging tiktoken watchfiles zstandard distro easydict gguf \
    'llguidance>=1.7.6,<2' blobfile==3.0.0 anthropic ninja pyyaml ipython dill jsonschema \
    soundfile==0.13.1 transformers==5.12.1 openai==2.6.1 openai-harmony==0.0.4 \
    xgrammar==0.2.1 compressed-tensors sentencepiece
fi
"$PIP" install -q pytest matplotlib
"$PIP" install -q --no-deps --no-build-isolation -e .
touch "$stamp"
