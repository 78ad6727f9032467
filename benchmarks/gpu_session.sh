#!/usr/bin/env bash
# Everything k3 runs on the H200, in one call of the device tool, cheapest-to-most-expensive, each step with its
# own time limit so one slow step cannot eat the others. Results land in $OUT (JSON + logs).
#   usage (device tool, carrying .whl with fla-core): bash benchmarks/gpu_session.sh [steps...]
#   steps: tests train decode cp kda   (default: tests train decode cp); T_TESTS=300 etc. override a step's limit (s)
set -u
OUT=${OUT:-/tmp/k3-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} FLA_CACHE_RESULTS=1  # autotune results kept in the cache dir
export K3_COMMIT=${K3_COMMIT:-unknown}
steps=${*:-tests train decode cp}
for s in $steps; do
  case $s in
    tests)  timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" ;;
    train)  timeout ${T_TRAIN:-420} python3 benchmarks/bench_train.py --json "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" ;;
    decode) timeout ${T_DECODE:-480} python3 benchmarks/bench_decode.py --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log" ;;
    cp)     timeout ${T_CP:-420} python3 benchmarks/bench_cp.py --json "$OUT/bench_cp.json" 2>&1 | tee "$OUT/bench_cp.log" ;;
    kda)    timeout ${T_KDA:-420} python3 benchmarks/bench_kda.py --json "$OUT/bench_kda.json" 2>&1 | tee "$OUT/bench_kda.log" ;;
    *) echo "unknown step $s (tests train decode cp kda)"; exit 2 ;;
  esac
done
