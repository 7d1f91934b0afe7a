#!/usr/bin/env bash
# Megatron-Bridge on the GPU machine: check apply_ep_plugin_backend against Bridge's own helper
# on this GPU, then train a Bridge-built tiny GPT-MoE on an ep_plugin backend and with
# Megatron's own alltoall dispatcher on the same data, and print the two loss columns.
#
#   examples/nemo/run_bridge_comparison.sh OUT_DIR [STEPS=50] [RANKS=4] [BACKEND=ep_hybrid]
#
# Needs, beside the repository: .whl/megatron_core-0.19.x-cp312-*.whl and .bridge_wheels/
# (megatron_bridge-0.6.2 and omegaconf-2.4.0, py3-none-any wheels; pip download --no-deps);
# everything else Bridge's model-config modules import (torch, PyYAML) is on the image.
# The plugin run uses RANKS processes sharing the GPU (gloo, private MPS daemon); the alltoall
# run one rank with RANKS micro-batches per step (see examples/megatron/README.md for why).
#
# TRAIN_ARGS: more bridge_train.py options for both runs (e.g. "--layers 2 --hidden 256").
#
# Writes to OUT_DIR: test_nemo_bridge.log, BACKEND.{log,json}, alltoall.{log,json}, loss.png,
# compare.txt (the per-step table). Exits non-zero when the test or a run failed; the runs go
# ahead after a failed test, so that one call gives everything there is.
set -uo pipefail
OUT_DIR=${1:?usage: run_bridge_comparison.sh OUT_DIR [STEPS] [RANKS] [BACKEND]}
STEPS=${2:-50}
RANKS=${3:-4}
BACKEND=${4:-ep_hybrid}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../install_site.sh
source "$ROOT/examples/install_site.sh"
install_site "$OUT_DIR" "megatron.core megatron.bridge omegaconf" \
    "$ROOT"/.whl/megatron_core-*.whl "$ROOT"/.bridge_wheels/*.whl || exit 1
python3 -c "import megatron.core, ep_plugin, torch
from ep_plugin.testing.bridge import bridge_missing_reason, bridge_version
print('megatron-core', megatron.core.__version__, '| megatron-bridge', bridge_version(),
      '| ep_plugin backends', ep_plugin.list_backends(), '| torch', torch.__version__,
      '| GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print('Bridge model-config modules:', bridge_missing_reason() or 'import')" || exit 1

failed=()
# -P: the repository root must not shadow the installed ep_plugin (which has the built _C).
(cd "$ROOT" && python3 -P -m pytest -q -p no:cacheprovider -W ignore::UserWarning --require-gpu \
    tests/test_nemo_bridge.py) 2>&1 | tee "$OUT_DIR/test_nemo_bridge.log" || failed+=(test_nemo_bridge)
# shellcheck disable=SC2086
python3 "$HERE/bridge_train.py" --ranks "$RANKS" --dispatcher "$BACKEND" --steps "$STEPS" ${TRAIN_ARGS:-} \
    --out "$OUT_DIR/$BACKEND.json" 2>&1 | tee "$OUT_DIR/$BACKEND.log" || failed+=("$BACKEND")
# shellcheck disable=SC2086
python3 "$HERE/bridge_train.py" --ranks 1 --grad-accum "$RANKS" --dispatcher alltoall --steps "$STEPS" ${TRAIN_ARGS:-} \
    --out "$OUT_DIR/alltoall.json" 2>&1 | tee "$OUT_DIR/alltoall.log" || failed+=(alltoall)
if [[ -f "$OUT_DIR/$BACKEND.json" && -f "$OUT_DIR/alltoall.json" ]]; then
    python3 "$ROOT/examples/megatron/plot_loss.py" "$OUT_DIR/$BACKEND.json" "$OUT_DIR/alltoall.json" --table \
        --title "Megatron-Bridge GPT-MoE: $BACKEND vs alltoall" --out "$OUT_DIR/loss.png" | tee "$OUT_DIR/compare.txt"
fi
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "all passed"
