#!/usr/bin/env bash
# Build a separate virtual environment with NVIDIA Dynamo 1.6.1 (CPU only) for
# `bench/vs_dynamo.py`: its Rust frontend and its mocker, no GPU, no etcd, no NATS.
#
# Usage: scripts/dynamo_env.sh [VENV_DIR]   (default: .venv-dynamo at the root)
#
# - ai-dynamo 1.6.1 goes in with --no-deps: it requires aisimulate==0.13.0, whose registry
#   entry is a stub that downloads the real wheel from a host outside the package registry.
# - Then the Rust core (ai-dynamo-runtime, an abi3 wheel) and the rest of ai-dynamo's
#   requirements, by hand. No torch: the mocker and the frontend need none.
# - The main development environment is not touched.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-dynamo}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check install --quiet)
"${PIP[@]}" --no-deps "ai-dynamo==1.6.1"
"${PIP[@]}" "ai-dynamo-runtime==1.6.1" "aiohttp>=3.14.3,<4" certifi "kubernetes>=32.0.1,<33" \
    msgspec prometheus-client pyzmq "redis>=6.2,<9" tqdm "transformers>=4.56" \
    typing-extensions zstandard
for module in dynamo.frontend dynamo.mocker; do  # both start: their imports resolve
    "$VENV/bin/python" -m "$module" --help >/dev/null
done
echo "Dynamo is in $VENV: python bench/vs_dynamo.py --dynamo-python $VENV/bin/python"
