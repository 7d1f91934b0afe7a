#!/usr/bin/env bash
# What a session runs on the lent GPU machine; each stage fits one device call (< 10 min):
#   scripts/gpu_validate.sh tests OUT [pytest args]   build, then the test suite (GPU tests included), or
#                                                     only the tests named in the pytest args
#   scripts/gpu_validate.sh gpu1 OUT [pytest args]    the GPU and Megatron tests (-m "gpu or megatron") in five
#   scripts/gpu_validate.sh gpu2 OUT [pytest args]    calls: gpu1 = test_elastic and test_hybrid, gpu2 = every
#   scripts/gpu_validate.sh gpu3 OUT [pytest args]    file not named here, gpu3 = the fault tests (they mostly
#   scripts/gpu_validate.sh gpu4 OUT [pytest args]    wait), gpu4 = the Megatron dispatcher file, gpu5 = scale-out,
#   scripts/gpu_validate.sh gpu5 OUT [pytest args]    reference on CUDA and the other Megatron and Bridge files
#                                                     (each 6-8 min of pytest or less on the slower H100s; four
#                                                     stages ran past a call there twice); pytest gets what is
#                                                     left of the call after the build, and its log names each
#                                                     passed test, so one cut short says where it stopped
#   scripts/gpu_validate.sh pending OUT               the GPU tests no GPU has run yet (scripts/pending_gpu_tests.txt),
#                                                     then one short standard-shape run of every compiled form
#                                                     (its value check; no figures to quote): the first call
#                                                     when device time is scarce
#   scripts/gpu_validate.sh bench OUT                 the standard and decode presets on one GPU (8 ranks sharing it,
#                                                     bulk and register copies), and the nvlink
#                                                     preset (one rank per GPU) when there are 2+ GPUs
#   scripts/gpu_validate.sh nvlink_tests OUT          the 2-GPU kind (nvidia-h200-x2), first: the 2-rank GPU tests
#                                                     (one rank per GPU, NCCL; NCCL rails; per-device streams and
#                                                     current device; register copies over NVLink), then
#                                                     test_faults_gpu (2 ranks, and 4 on two GPUs) in the time left
#   scripts/gpu_validate.sh nvlink OUT                the 2-GPU kind, its figures: the nvlink preset (hybrid,
#                                                     elastic, reference and the all_to_all baseline) and the
#                                                     in-place variants at 24 SMs
#   scripts/gpu_validate.sh sweep OUT                 the full sweep (8 ranks sharing GPU 0; SM counts and
#                                                     shapes that do not fit are skipped with a message)
#   scripts/gpu_validate.sh megatron OUT              the Megatron GPT-MoE loss comparison
#   scripts/gpu_validate.sh scaleout OUT              what gloo moves on this GPU, then the scale-out tests
#                                                     (hybrid, elastic at 1x8 / 2x4 / 4x2 / 8x1 forced domains)
#   scripts/gpu_validate.sh scaleout_bench OUT        standard shape, bf16: 1x8 vs 2x4 in one run (8 ranks)
#   [STEPS=N] scripts/gpu_validate.sh nemo OUT        Megatron-Bridge: tests/test_nemo_bridge.py on this GPU, then
#                                                     a Bridge-built GPT-MoE on ep_hybrid vs alltoall, STEPS
#                                                     steps (default 50; needs .bridge_wheels/ too:
#                                                     examples/nemo/README.md)
# Every stage builds first and stops, with the build log's tail, unless ep_plugin._C imports and sees a
# GPU; GPU tests then fail instead of skipping (EP_PLUGIN_REQUIRE_GPU=1). Megatron-core comes from a
# carried wheel in .whl/ (the GPU image has none): the stages that run Megatron stop without it (its
# tests would skip, green). The exit status is the first failure's (pytest's, a bench run's, a script's).
# Logs, JSON and plots end up in OUT/results.tgz (the device returns at most 8 files).
# A call with a timeout_s below 600 passes it as CALL_S=N: pytest and the bench runs end inside it, with their
# logs, instead of the device killing the call before any log comes back.
set -uo pipefail
RC=0  # the exit status: the first failure's (fail)
STAGE=${1:?stage: tests, gpu1, gpu2, gpu3, gpu4, gpu5, pending, bench, nvlink_tests, nvlink, sweep, megatron, nemo, scaleout or scaleout_bench}
OUT=${2:?output folder}
shift 2
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
END=$(( ${CALL_S:-600} - 25 ))  # when this script's own timeouts end: before the device's (20 s for a SIGKILL)
mkdir -p "$OUT"
if ls .whl/megatron_core-*.whl >/dev/null 2>&1 && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "WARNING: the carried megatron-core wheel did not install"
  export PYTHONPATH=/tmp/site
fi
# GPU tests fail, never skip, when CUDA or ep_plugin._C is missing (tests/conftest.py).
export EP_PLUGIN_REQUIRE_GPU=1
stop() {  # stop REASON: say why, with setup.py's and the compiler's lines and the build log's tail; exit 1
  echo "STOPPED: $1"
  echo "--- setup.py and compiler lines of /tmp/build.log ---"
  grep -E "^ *ep_plugin: |\): error|: error:|error detected|fatal error|undefined reference" /tmp/build.log \
    | cut -c1-300 | awk '!seen[$0]++' | head -30
  echo "--- tail of /tmp/build.log ---"
  tail -20 /tmp/build.log | cut -c1-300
  exit 1
}
touch /tmp/build.stamp
python3 -m pip install -v --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || stop "pip install failed"
# pip also succeeds when setup.py found no nvcc (or EP_PLUGIN_NO_CUDA is set) and skipped the extension;
# an ep_plugin/_C*.so left by an earlier build would then still import, built from other sources.
[[ -n "$(find ep_plugin -maxdepth 1 -name '_C*.so' -newer /tmp/build.stamp)" ]] \
  || stop "this build produced no ep_plugin/_C*.so (nvcc not found, or EP_PLUGIN_NO_CUDA set)"
python3 -c "import ep_plugin._C" >> /tmp/build.log 2>&1 || stop "ep_plugin._C does not import"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "from ep_plugin import _cuda; print(_cuda.describe()); raise SystemExit(not _cuda.available())" \
  >> /tmp/build.log 2>&1 && [[ "$GPUS" -ge 1 ]] || stop "no usable CUDA device (torch sees $GPUS)"
echo "build ok: ep_plugin._C imports; $GPUS GPU(s)"
case "$STAGE" in  # the stages whose Megatron tests or scripts would skip (or fail late) without it
  tests|gpu4|gpu5|pending|nvlink_tests|megatron|nemo)
    python3 -c "import megatron.core" 2>/dev/null || stop "no megatron-core here: carry .whl/ (a cp312 wheel)" ;;
esac

fail() {  # fail RC: keep the first nonzero status as the stage's exit status
  (( RC )) || RC=$1
}

enough_left() {  # enough_left SECONDS: whether the call has that much left (else says so): `timeout 0` is none
  (( END - SECONDS >= $1 )) && return 0
  echo "not run: $SECONDS s of the call used"; return 1
}

pytest_run() {  # pytest_run SECONDS LOG TAIL ARGS...: pytest under a timeout (SIGKILL 20 s after its SIGTERM)
  local seconds=$1 log=$2 lines=$3; shift 3
  if (( seconds < 30 )); then  # `timeout 0` would mean none, and a negative one is an error
    echo "pytest: not run, $SECONDS s of the call used" | tee "$log"; fail 1; return
  fi
  timeout -k 20 "$seconds" python3 -m pytest -q -p no:cacheprovider --require-gpu "$@" 2>&1 | tee "$log" \
    | tail -"$lines"
  local rc=${PIPESTATUS[0]}
  echo "pytest rc=$rc"
  fail "$rc"
}

bench() {  # bench NAME ARGS...: one benchmark run, its table into the log, JSON + plots under OUT/NAME
  local name=$1; shift
  local seconds=$(( END - SECONDS < 300 ? END - SECONDS : 300 ))  # what is left of the call, at most 300 s
  if (( seconds < 60 )); then
    echo "== $name: not run, $SECONDS s of the call used"; fail 1; return
  fi
  # The bench's own --timeout ends it first (an explicit one in ARGS comes later and wins): it then writes
  # the cases that finished, where the outer timeout would leave nothing.
  timeout -k 20 "$seconds" python3 -m ep_plugin.bench --out "$OUT/$name" --timeout $(( seconds - 15 )) "$@" 2>&1 \
    | grep -v "case/s" > "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name (rc $rc): $*"; sed -n '/^ *backend/,$p' "$OUT/$name.log" | cut -c1-200
  if (( rc )); then
    tail -15 "$OUT/$name.log" | cut -c1-300  # a failed run has no table: its traceback says why
    fail "$rc"
  fi
}

case "$STAGE" in
  tests)
    nvidia-smi topo -m | head -4
    python3 -m ep_plugin info | head -3
    pytest_run $((END - SECONDS < 500 ? END - SECONDS : 500)) "$OUT/pytest.log" 25 --durations=6 "${@:-tests}"
    ;;
  gpu1|gpu2|gpu3|gpu4|gpu5)
    HEAVY=(tests/test_elastic.py tests/test_hybrid.py)  # the two longest GPU files, about half the GPU time
    # Files that mostly wait (timeouts, peers that fail on purpose): gpu2 alone ran past its call on a cold
    # machine, and the faults with scale-out and reference on CUDA did on a slow one.
    FAULTS=(tests/test_faults_gpu.py)
    # Every Megatron test launches ranks that import Megatron (~20 s each on the GPU machine): the dispatcher
    # file alone is a call on a slow H100.
    DISPATCHER=(tests/test_megatron_dispatcher.py)
    REST=(tests/test_scaleout_gpu.py tests/test_reference_gpu.py tests/test_megatron_arena.py
          tests/test_megatron_integration.py tests/test_nemo_bridge.py)
    case $STAGE in
      gpu1) FILES=("${HEAVY[@]}") ;;
      gpu2) FILES=(tests "${HEAVY[@]/#/--ignore=}" "${FAULTS[@]/#/--ignore=}" "${DISPATCHER[@]/#/--ignore=}"
                   "${REST[@]/#/--ignore=}") ;;
      gpu3) FILES=("${FAULTS[@]}") ;;
      gpu4) FILES=("${DISPATCHER[@]}") ;;
      gpu5) FILES=("${REST[@]}") ;;
    esac
    # -rfEsp: the summary names every passed test too, also when the timeout cuts pytest short.
    pytest_run $((END - SECONDS)) "$OUT/pytest.log" 25 --durations=8 -rfEsp -m "gpu or megatron" "${FILES[@]}" "$@"
    ;;
  pending)
    mapfile -t PENDING < <(grep -v '^#' scripts/pending_gpu_tests.txt | grep .)
    if (( ${#PENDING[@]} )); then
      pytest_run $((END - 205 - SECONDS)) "$OUT/pytest_pending.log" 20 --durations=6 -m "gpu or megatron" "${PENDING[@]}"
    fi
    CUDA_VISIBLE_DEVICES=0 bench forms --preset standard --ranks 8 --backends hybrid,hybrid+in_place,hybrid+arena,elastic,elastic+in_place \
      --modes blocking,nonblocking --payloads bf16,fp8 --warmup 2 --iters 3 --graph  # bench() sets its --timeout
    ;;
  bench)
    CUDA_VISIBLE_DEVICES=0 bench standard --preset standard --ranks 8
    CUDA_VISIBLE_DEVICES=0 EP_PLUGIN_BULK_COPY=0 bench standard_register --preset standard --ranks 8 \
      --backends hybrid --payloads bf16
    CUDA_VISIBLE_DEVICES=0 bench decode --preset decode --ranks 8 --backends hybrid --graph
    if [[ "$GPUS" -ge 2 ]]; then
      bench nvlink --preset nvlink --ranks 2
    fi
    ;;
  sweep)
    CUDA_VISIBLE_DEVICES=0 bench full --preset full --ranks 8
    ;;
  nvlink)  # the figures only this kind can give (its tests: nvlink_tests, a call of their own)
    [[ "$GPUS" -ge 2 ]] || { echo "STOPPED: the nvlink stage needs 2 GPUs (the nvidia-h200-x2 kind), this machine has $GPUS"; exit 1; }
    nvidia-smi topo -m | head -4
    bench nvlink --preset nvlink --ranks 2
    bench nvlink_in_place --preset nvlink --ranks 2 --backends hybrid+in_place,elastic+in_place,all_to_all \
      --payloads bf16 --sms 24
    ;;
  nvlink_tests)  # one rank per GPU (NCCL groups, gloo twins, peer access across GPUs), then mixed placements
    [[ "$GPUS" -ge 2 ]] || { echo "STOPPED: the nvlink_tests stage needs 2 GPUs (the nvidia-h200-x2 kind), this machine has $GPUS"; exit 1; }
    nvidia-smi topo -m | head -4
    # 2-rank cases (one rank per GPU here), the register-copy paths over NVLink, and the tests that need two GPUs.
    pytest_run $((END - 185 - SECONDS)) "$OUT/pytest_nvlink.log" 15 --durations=6 -m "gpu or megatron" tests \
      -k "[2] or two_gpus or per_device or nccl_group or register_copies"
    # Faults with 2 ranks (one per GPU) and 4 (two per GPU): timeouts and refusals over NCCL, in the time left.
    pytest_run $((END - SECONDS)) "$OUT/pytest_nvlink_faults.log" 15 --durations=4 tests/test_faults_gpu.py
    ;;
  scaleout)
    timeout 60 python3 scripts/gloo_probe.py 2>&1 | tee "$OUT/gloo_probe.log"
    pytest_run $((END - SECONDS)) "$OUT/pytest_scaleout.log" 25 --durations=6 tests/test_scaleout_gpu.py
    ;;
  scaleout_bench)
    CUDA_VISIBLE_DEVICES=0 bench scaleout --preset standard --ranks 8 --backends hybrid,elastic --payloads bf16 \
      --scaleup-size 8,4 --iters 5
    ;;
  megatron)
    enough_left 60 && timeout -k 20 $((END - SECONDS < 300 ? END - SECONDS : 300)) \
      examples/megatron/run_comparison.sh /tmp/megatron 50 4 ep_hybrid > "$OUT/megatron.log" 2>&1
    rc=$?
    echo "megatron rc=$rc"; tail -5 "$OUT/megatron.log"
    fail "$rc"
    cp /tmp/megatron/loss.png /tmp/megatron/compare.txt "$OUT/" 2>/dev/null
    ;;
  nemo)
    enough_left 60 && timeout -k 20 $((END - SECONDS < 480 ? END - SECONDS : 480)) \
      examples/nemo/run_bridge_comparison.sh /tmp/nemo "${STEPS:-50}" 4 ep_hybrid > "$OUT/nemo.log" 2>&1
    rc=$?
    echo "nemo rc=$rc"
    fail "$rc"
    grep -E "^megatron-core|^Bridge model-config|passed|failed|error|FAILED|STOPPED" "$OUT/nemo.log" | cut -c1-300 | head -20
    cat /tmp/nemo/compare.txt 2>/dev/null
    cp /tmp/nemo/loss.png /tmp/nemo/compare.txt /tmp/nemo/*.json "$OUT/" 2>/dev/null
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/"
exit "$RC"
