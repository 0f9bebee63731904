#!/usr/bin/env bash
# The reference venv: Hugging Face transformers and torch (CPU), where scripts/reference/ computes
# the reference data in tests/data. Dev-only: never a forge dependency and never forge's .venv.
#
#   scripts/reference/refvenv.sh          # create it if needed (a few minutes); print its python's path
#   "$(scripts/reference/refvenv.sh)" scripts/reference/make_reference.py
#
#   REFVENV   where it lives (default: $HOME/.cache/forge-refvenv)
#   PYTHON    the python that creates it (default: python3)
# The committed data records the versions it was made with (each file's "versions").
set -euo pipefail

REFVENV="${REFVENV:-$HOME/.cache/forge-refvenv}"
PYTHON="${PYTHON:-python3}"
PACKAGES=(torch==2.13.0 transformers gguf jinja2 numpy accelerate sentencepiece sentence-transformers tiktoken)

case "${1:-}" in
  "") ;;
  *) echo "usage: scripts/reference/refvenv.sh   (REFVENV=DIR to put it elsewhere)" >&2; exit 2 ;;
esac
if ! "$REFVENV/bin/python" -c 'import torch, transformers, gguf, sentencepiece, sentence_transformers, tiktoken' 2>/dev/null; then
  echo "refvenv: installing ${PACKAGES[*]} into $REFVENV" >&2
  "$PYTHON" -m venv "$REFVENV"
  "$REFVENV/bin/pip" install -q "${PACKAGES[@]}" >&2
fi
echo "$REFVENV/bin/python"
