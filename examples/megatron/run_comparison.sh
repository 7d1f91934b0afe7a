#!/usr/bin/env bash
# Train the GPT-MoE example on an ep_plugin backend and with Megatron's own alltoall
# dispatcher, then plot both loss curves into one PNG.
#
#   examples/megatron/run_comparison.sh OUT_DIR [STEPS=50] [RANKS=4] [BACKEND=ep_hybrid]
#
# The plugin run uses RANKS processes (EP = RANKS; ranks share the GPUs there are, over gloo
# under a private MPS daemon when they outnumber them). The alltoall run uses one rank with
# RANKS micro-batches per step: the same data, initial weights and optimizer steps (see
# train_gpt_moe.py), because Megatron's alltoall dispatcher needs NCCL, which refuses two
# ranks on one GPU. With one GPU per rank, set A2A_RANKS=RANKS to run alltoall on RANKS ranks.
#
# Installs what is missing into $EP_SITE (default /tmp/site; examples/install_site.sh): megatron-core
# from a wheel in .whl/ (megatron_core-0.19.x-cp312-...whl; its needs torch, numpy, packaging are on
# the image) and this repository (building ep_plugin._C with nvcc).
set -euo pipefail
OUT_DIR=${1:?usage: run_comparison.sh OUT_DIR [STEPS] [RANKS] [BACKEND]}
STEPS=${2:-50}
RANKS=${3:-4}
BACKEND=${4:-ep_hybrid}
A2A_RANKS=${A2A_RANKS:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../install_site.sh
source "$ROOT/examples/install_site.sh"
wheels=("$ROOT"/.whl/megatron_core-*.whl)
if [[ ! -e "${wheels[0]}" ]] && ! python3 -c "import megatron.core" 2>/dev/null; then
    echo "run_comparison.sh: python3 has no megatron-core and .whl/ holds no megatron_core wheel: pip install" \
         "megatron-core (0.16.x on Python 3.11, 0.19.x on 3.12), or put its wheel in $ROOT/.whl/" >&2
    exit 2
fi
install_site "$OUT_DIR" megatron.core "${wheels[@]}"
python3 -c "import megatron.core, ep_plugin, torch; print('megatron-core', megatron.core.__version__, \
'| ep_plugin backends', ep_plugin.list_backends(), '| torch', torch.__version__)"

python3 "$HERE/train_gpt_moe.py" --ranks "$RANKS" --dispatcher "$BACKEND" --steps "$STEPS" \
    --out "$OUT_DIR/$BACKEND.json" 2>&1 | tee "$OUT_DIR/$BACKEND.log"
python3 "$HERE/train_gpt_moe.py" --ranks "$A2A_RANKS" --grad-accum $((RANKS / A2A_RANKS)) --dispatcher alltoall \
    --steps "$STEPS" --out "$OUT_DIR/alltoall.json" 2>&1 | tee "$OUT_DIR/alltoall.log"
python3 "$HERE/plot_loss.py" "$OUT_DIR/$BACKEND.json" "$OUT_DIR/alltoall.json" --out "$OUT_DIR/loss.png" \
    | tee "$OUT_DIR/compare.txt"
