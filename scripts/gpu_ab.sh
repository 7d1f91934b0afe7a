#!/usr/bin/env bash
# Same-call A/B of a change on the lent GPU machine: the machine's speed varies between sessions and
# its host pace between rounds of one call, so "before" and "after" must run interleaved in one call.
#
#   scripts/gpu_ab.sh prepare REF            here: export commit REF's tree into .ab/base (ignored by
#                                            git; carry ".ab" to the device)
#   scripts/gpu_ab.sh run OUT ROUNDS CMD...  on the device: build the working tree ("new") and .ab/base
#                                            ("base", in /tmp/ab_base), then run CMD in each tree,
#                                            ROUNDS times each, the first tree alternating (new, base,
#                                            base, new, new, base, ...: a side that always ran first
#                                            would get the machine's drift over the call);
#                                            CMD's output goes to OUT/{new,base}_{round}.log and its last
#                                            lines to the terminal. CMD runs with the tree as its working
#                                            folder and first on PYTHONPATH, so `python3 -m ep_plugin.bench`
#                                            and `python3 benchmarks/host_costs.py` time that tree's code.
#                                            A bench run's bench.json (the tree's ./bench_out, the
#                                            default --out, which is cleared before each run) moves
#                                            to OUT/{new,base}_{round}.json, and
#                                            once every round ran, bench.compare prints new against
#                                            base (python3 -m ep_plugin.bench.compare: the slowest cases
#                                            and the geomean per op; run it here on the JSON files for
#                                            all of it). The script exits 1 if a round trip or step got
#                                            more than 5% slower (per-op columns trade time with each
#                                            other within a run), or base ran one that new did not.
#                                            The device returns at most 8 files of a call's $OUT, so
#                                            keep ROUNDS <= 4 (2 with bench.json files; or pack OUT
#                                            into one .tgz before the call ends); files past the limit
#                                            are lost.
# Example (decode round trips, three rounds each):
#   scripts/gpu_ab.sh prepare main     # then, on the device, with carry [".ab"]:
#   scripts/gpu_ab.sh run "$OUT" 3 python3 -m ep_plugin.bench --preset decode --ranks 8 --graph --backends hybrid
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?mode: prepare or run}
shift
case "$MODE" in
  prepare)
    REF=${1:?commit to compare against}
    rm -rf .ab/base && mkdir -p .ab/base
    git archive "$REF" | tar -x -C .ab/base
    grep -qx "/.ab/" .git/info/exclude 2>/dev/null || echo "/.ab/" >> .git/info/exclude
    echo "base = $(git rev-parse --short "$REF") in .ab/base ($(du -sh .ab/base | cut -f1)); carry \".ab\""
    ;;
  run)
    OUT=${1:?output folder}
    ROUNDS=${2:?rounds}
    shift 2
    [[ $# -gt 0 ]] || { echo "no command to run"; exit 2; }
    [[ -d .ab/base ]] || { echo "no .ab/base: run 'scripts/gpu_ab.sh prepare REF' here and carry .ab"; exit 2; }
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    rm -rf /tmp/ab_base && cp -r .ab/base /tmp/ab_base
    (cd /tmp/ab_base && python3 setup.py -q build_ext --inplace > /tmp/ab_base_build.log 2>&1) &
    python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/ab_new_build.log 2>&1
    NEW_RC=$?
    wait $!
    BASE_RC=$?
    if [[ $NEW_RC -ne 0 || $BASE_RC -ne 0 ]]; then
      echo "build failed (new rc=$NEW_RC, base rc=$BASE_RC)"
      tail -5 /tmp/ab_new_build.log /tmp/ab_base_build.log
      exit 1
    fi
    for tree in "$PWD" /tmp/ab_base; do  # which package each side imports (a wrong one would void the A/B)
      (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
        'import os, sys, ep_plugin, ep_plugin._C; print("imports", ep_plugin.__file__)
sys.exit(not os.path.realpath(ep_plugin.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep))' "$tree") \
        || { echo "STOPPED: the $tree side does not import its own ep_plugin"; exit 1; }
    done
    FAILED_ROUNDS=()  # a round whose command failed (or, for a bench run, wrote no bench.json) fails the A/B
    BENCH=0
    [[ "$*" == *ep_plugin.bench* ]] && BENCH=1  # its rounds must leave figures (other commands print theirs)
    for round in $(seq 1 "$ROUNDS"); do
      order="new base"
      (( round % 2 == 0 )) && order="base new"
      for side in $order; do
        tree=$PWD
        [[ $side == base ]] && tree=/tmp/ab_base
        rm -rf "$tree/bench_out"
        (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$@") > "$OUT/${side}_$round.log" 2>&1
        round_rc=$?
        echo "== $side, round $round (rc $round_rc)"
        grep -v "case/s" "$OUT/${side}_$round.log" | tail -12 | cut -c1-160
        if [[ -f "$tree/bench_out/bench.json" ]]; then
          mv "$tree/bench_out/bench.json" "$OUT/${side}_$round.json"
        elif [[ $BENCH -eq 1 && $round_rc -eq 0 ]]; then
          round_rc=1  # a bench run without figures: a failure even where the command said 0
        fi
        [[ $round_rc -ne 0 ]] && FAILED_ROUNDS+=("$side $round (rc $round_rc)")
      done
    done
    if compgen -G "$OUT/new_*.json" > /dev/null && compgen -G "$OUT/base_*.json" > /dev/null; then
      echo "== bench.compare, new against base, every op (the slowest cases, the geomeans)"
      python3 -m ep_plugin.bench.compare --new "$OUT"/new_*.json --base "$OUT"/base_*.json > /tmp/ab_compare.txt
      grep -v "^only in" /tmp/ab_compare.txt | head -12 | cut -c1-160
      grep -E "^geomean|cases compared" /tmp/ab_compare.txt
      # The verdict: round trips (and step rows where both trees have them). Time moves between the
      # dispatch and combine columns of one run, so a per-op column alone can flag a faster op pair.
      echo "== bench.compare --ops roundtrip,step (the exit status)"
      python3 -m ep_plugin.bench.compare --ops roundtrip,step --new "$OUT"/new_*.json --base "$OUT"/base_*.json \
        | grep -v "^only in" | tail -8 | cut -c1-160
      RC=${PIPESTATUS[0]}
    elif [[ $BENCH -eq 1 ]]; then
      echo "== no compare: a side wrote no bench.json in any round"
      RC=1
    fi
    if [[ ${#FAILED_ROUNDS[@]} -gt 0 ]]; then  # a side that crashes must not pass as "no regression"
      echo "== FAILED rounds: ${FAILED_ROUNDS[*]}"
      RC=1
    fi
    exit "${RC:-0}"
    ;;
  *) echo "unknown mode $MODE (prepare or run)"; exit 2 ;;
esac
