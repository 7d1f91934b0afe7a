#!/usr/bin/env bash
# What a session runs on the lent GPU machine, in two stages that each fit one device call:
#   scripts/gpu_validate.sh tests OUT    build, the whole test suite (GPU tests included), the demo
#   scripts/gpu_validate.sh bench OUT    the issue-5 benchmark presets and the Megatron loss comparison
# Megatron-core comes from a carried wheel in .whl/ (the GPU image has none).
set -uo pipefail
STAGE=${1:?stage: tests or bench}
OUT=${2:?output folder}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ls .whl/megatron_core-*.whl >/dev/null 2>&1 && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
if [[ "$STAGE" == tests ]]; then
  nvidia-smi -L
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  python3 -m ep_plugin info | head -3
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests --durations=8 2>&1 | tee "$OUT/pytest.log" | tail -25
  timeout 120 python3 -m ep_plugin demo --ranks 4 --steps 20 > "$OUT/demo.log" 2>&1
  echo "demo rc=$?"; grep -E "^step|^loss" "$OUT/demo.log" | tail -4
elif [[ "$STAGE" == bench ]]; then
  timeout 200 python3 -m ep_plugin.bench --preset standard --ranks 8 --out "$OUT/standard" 2>&1 \
    | grep -v "case/s" | tee "$OUT/bench_standard.log" | tail -12
  timeout 120 python3 -m ep_plugin.bench --preset decode --ranks 8 --backends hybrid --out "$OUT/decode" 2>&1 \
    | grep -v "case/s" | tee "$OUT/bench_decode.log" | tail -8
  if [[ -x examples/megatron/run_comparison.sh ]]; then
    # The device returns at most 8 files: keep the plot and the comparison, leave the rest in /tmp.
    timeout 240 examples/megatron/run_comparison.sh /tmp/megatron 50 4 ep_hybrid > "$OUT/megatron.log" 2>&1
    echo "megatron rc=$?"; tail -5 "$OUT/megatron.log"
    cp /tmp/megatron/loss.png /tmp/megatron/compare.txt "$OUT/" 2>/dev/null
  fi
fi
