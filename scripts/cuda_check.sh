#!/usr/bin/env bash
# The engine on CUDA, in one go (for a machine with an NVIDIA GPU; CI never runs this):
#   1. the engine's tests with the engine and the HF reference on cuda (KVBATON_TEST_DEVICE),
#      including the bfloat16/float16 agreement check, which is skipped on the CPU, and the
#      KV tiers' tests (the cache's host mirror pinned);
#   2. bench/engine.py on a random-weight model of SmolLM2-135M's shape, bfloat16 on cuda.
# Logs go to $OUT (default /tmp/cuda_check). Wheels of packages the machine lacks may wait in
# .whl/ (installed into /tmp/site first).
#
#   scripts/cuda_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.log"

KVBATON_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest tests/engine \
    tests/kv_tiers -q -m "not slow" -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/tests.log"
tests_rc=$?

timeout "${BENCH_TIMEOUT:-240}" python3 bench/engine.py --random-weights --device cuda \
    --dtype bfloat16 --trials "${TRIALS:-3}" 2>&1 | tee "$OUT/bench.log"
bench_rc=$?

echo "tests rc=$tests_rc, bench rc=$bench_rc" | tee -a "$OUT/env.log"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
