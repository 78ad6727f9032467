#!/usr/bin/env bash
# Everything k3 runs on GPUs, in one call of the device tool, each step with its own time limit so one slow step
# cannot eat the others. Results land in $OUT, packed at the end into $OUT/gpu_session.tgz (JSON + logs) and
# $OUT/autotune.tgz (fla's Triton autotuning results: extract into .tcache/ and carry it next time to skip it).
#   usage (device tool, carrying .whl with fla-core, and .tcache if you have one): bash benchmarks/gpu_session.sh [steps...]
#   one GPU:  tests serve http router decode train trainc ktrain profile memory cp kda kdadec attnres tkern muon packed quant qdecode
#             post
#             (default: tests serve train cp)
#   2+ GPUs:  nccl flacp kcp scale             (the distributed suite over NCCL, fla CP vs KCP, multi-GPU throughput)
#   T_TESTS=300 etc. (T_<STEP>, upper case) override a step's limit in seconds.
#   TESTS replaces the tests step's test files (pytest arguments).
#   TRAIN_ARGS replaces trainc's extra bench_train arguments (default: --memory-policy keep,efficient: each row
#   under keep when it fits, else efficient).
#   DECODE_ARGS adds bench_decode arguments (e.g. --sections k3,ttft,peer --batches 1,32); QUANT_ARGS adds
#   bench_quant arguments (e.g. --decode-presets small,medium); POST_ARGS replaces post's sizes (post_demo arguments);
#   MEMORY_ARGS replaces memory's batch and length (bench_memory arguments); KTRAIN_ARGS ktrain's steps and flags;
#   TKERN_ARGS adds bench_train_kernels arguments (e.g. --conv-configs 64x128x4,32x128x4).
set -u
OUT=${OUT:-/tmp/k3-gpu}
mkdir -p "$OUT/logs"
# an earlier invocation in the same $OUT packed its logs and removed them: unpack them, so this one's pack keeps both
[ -f "$OUT/gpu_session.tgz" ] && tar xzf "$OUT/gpu_session.tgz" -C "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # once per machine: two sessions side by side (one per GPU) share it
  [ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:. PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} FLA_CACHE_RESULTS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export K3_COMMIT=${K3_COMMIT:-unknown}
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
# fla's autotuning results, kept in the repo (benchmarks/autotune/*.tgz) and/or carried as .tcache/
for t in benchmarks/autotune/*.tgz; do [ -f "$t" ] && tar xzf "$t" -C "$TRITON_CACHE_DIR"; done
[ -d .tcache ] && cp -r .tcache/. "$TRITON_CACHE_DIR"/
[ -f .tcache/inductor.tgz ] && tar xzf .tcache/inductor.tgz -C "$TORCHINDUCTOR_CACHE_DIR"
L=$OUT/logs
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TR="python3 -m torch.distributed.run --nproc_per_node"
steps=${*:-tests serve train cp}
for s in $steps; do
  case $s in
    tests)  timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider -W ignore ${TESTS:-tests/gpu/test_fla.py tests/gpu/test_train_gpu.py tests/gpu/test_vision_gpu.py tests/gpu/test_rollout_gpu.py} 2>&1 | tee "$L/gpu_tests.log" ;;
    # the engine: decode kernels compiled, graph runner == eager runner == full forward, then the decode benchmark
    serve)  timeout ${T_SERVE_TESTS:-420} python3 -m pytest -q -s -p no:cacheprovider -W ignore tests/ops/test_decode_kernels.py tests/ops/test_proj_decode.py tests/ops/test_attn_res_kernel.py tests/gpu/test_engine_parts_gpu.py tests/gpu/test_engine_gpu.py 2>&1 | tee "$L/serve_tests.log"
            timeout ${T_SERVE:-420} python3 benchmarks/bench_decode.py --profile ${DECODE_ARGS:-} --json "$L/bench_decode.json" 2>&1 | tee "$L/bench_decode.log" ;;
    # k3 serve over HTTP (bench_serve): small, short prompts at concurrency 1 and 64 (two client processes) with the
    # engine alone beside it and py-spy on the server, then 1,500-token prompts at 64
    http)   timeout ${T_HTTP:-400} python3 benchmarks/bench_serve.py --engine --concurrency 1,64 --client-procs 2 --pyspy "$L/serve_pyspy.txt" --json "$L/bench_serve.json" -- --preset small --random-init --device cuda ${HTTP_ARGS:-} 2>&1 | tee "$L/bench_serve.log"
            timeout ${T_HTTP_LONG:-240} python3 benchmarks/bench_serve.py --concurrency 64 --prompt-len 1500 --output-len 128 --requests 128 --json "$L/bench_serve_long.json" -- --preset small --random-init --device cuda ${HTTP_ARGS:-} 2>&1 | tee "$L/bench_serve_long.log" ;;
    # k3 router over 3 replicas of small sharing the GPU (a quarter of its free memory each): affinity against
    # round-robin and first-block hashing on one workload (needs aiohttp and uhashring: carry their wheels in .whl/)
    router) timeout ${T_ROUTER:-540} python3 benchmarks/bench_router.py --rounds 1 --sessions ${ROUTER_SESSIONS:-48} --turns 8 --system-tokens 1024 --turn-tokens 512 --burst 8 --burst-tokens 32768 --max-tokens 32 --router-args "--classes short=0:0.75,long=16384:0.25 --max-inflight 32" --json "$L/bench_router.json" -- --preset small --random-init --device cuda --memory-fraction 0.25 --hash-block 512 ${ROUTER_ARGS:-} 2>&1 | tee "$L/bench_router.log" ;;
    # the decode benchmark alone (DECODE_ARGS as above)
    decode) timeout ${T_DECODE:-420} python3 benchmarks/bench_decode.py --profile ${DECODE_ARGS:-} --json "$L/bench_decode.json" 2>&1 | tee "$L/bench_decode.log" ;;
    # k3 small and medium on uniform and corpus documents, and the dense same-width peers, 8 x 4096 tokens
    train)  timeout ${T_TRAIN:-590} python3 benchmarks/bench_train.py --json "$L/bench_train.json" 2>&1 | tee "$L/bench_train.log" ;;
    # the same with regional torch.compile (the peer whole-model), each row under keep if it fits, else efficient
    trainc) timeout ${T_TRAINC:-590} python3 benchmarks/bench_train.py --compile ${TRAIN_ARGS:---memory-policy keep,efficient} --json "$L/bench_train_compile.json" 2>&1 | tee "$L/bench_train_compile.log" ;;
    # `k3 train` itself on the embedded corpus at the benchmark's size (KTRAIN_ARGS replaces its steps and flags),
    # its metrics.jsonl kept: the tokens/s it logs against bench_train's corpus row
    ktrain) timeout ${T_KTRAIN:-420} python3 -m k3 train --preset small --compile --seq-len 4096 --batch-size 8 --vocab-size 32768 --data-max-bytes 3000000 --log-every 5 --save-every 1000 --out /tmp/k3-ktrain ${KTRAIN_ARGS:---steps 30 --cuda-graph} 2>&1 | tee "$L/k3_train.log"
            cp /tmp/k3-ktrain/metrics.jsonl "$L/k3_train_metrics.jsonl" 2>/dev/null ;;
    # one profiled step per row: top kernels and the device's idle gaps, into logs/profile/
    profile) timeout ${T_PROFILE:-590} python3 benchmarks/bench_train.py --steps 3 --profile "$L/profile" --json "$L/bench_train_profile.json" 2>&1 | tee "$L/bench_train_profile.log" ;;
    # peak memory per activation policy, medium at 2 x 4096 tokens (at 8 x 4096 eager layers fit neither keep nor
    # efficient; MEMORY_ARGS replaces the size)
    memory) timeout ${T_MEMORY:-590} python3 benchmarks/bench_memory.py --preset medium ${MEMORY_ARGS:---batch 2 --seq-len 4096} --json "$L/bench_memory.json" 2>&1 | tee "$L/bench_memory.log" ;;
    cp)     timeout ${T_CP:-420} python3 benchmarks/bench_cp.py --json "$L/bench_cp.json" 2>&1 | tee "$L/bench_cp.log" ;;
    # packed documents: MLA's length groups and the unpadded short conv against padded rows, on the GPU
    packed) timeout ${T_PACKED:-300} python3 benchmarks/bench_packed.py --ops mla,conv --batches 3 --json "$L/bench_packed.json" 2>&1 | tee "$L/bench_packed.log" ;;
    # MXFP4 experts: the packed-path GPU tests, then the packed grouped matmul and decode against bf16
    quant)  timeout ${T_QUANT:-480} bash -c "python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_quant.py tests/ops/test_mx.py; python3 benchmarks/bench_quant.py --sections gpu,memory ${QUANT_ARGS:-} --json $L/bench_quant.json" 2>&1 | tee "$L/bench_quant.log" ;;
    # decode through the engine alone, bf16 experts against packed MXFP4 (QUANT_ARGS, e.g. --decode-presets medium
    # --no-decode-compile: compiling two medium engines outlasted 200 s)
    qdecode) timeout ${T_QDECODE:-300} python3 benchmarks/bench_quant.py --sections decode ${QUANT_ARGS:-} --json "$L/bench_quant_decode.json" 2>&1 | tee "$L/bench_quant_decode.log" ;;
    # post-training on small: SFT -> RL at max effort -> RL at low and high (issue 17's GPU run), sized for one
    # call: a device call cannot carry a small checkpoint to the next one, so every stage must fit one step's limit
    # (rollouts in bf16 under CUDA graphs, --rollout-dtype auto); POST_ARGS replaces the sizes.
    # SFT in batches of 64 x 128 tokens: at 8 (the CPU default) the eager step is launch-bound at ~3.5K tokens/s
    post)   timeout ${T_POST:-590} python3 benchmarks/post_demo.py --preset small --device cuda --tasks parity,sorting --difficulty parity=16,sorting=8 --stages sft,rl,low ${POST_ARGS:---sft-batch 64 --sft-steps 300 --rl-steps 30 --low-steps 30 --max-tokens 256 --eval-problems 96} --out /tmp/k3-post 2>&1 | tee "$L/post_demo.log"
            cp /tmp/k3-post/results.json /tmp/k3-post/*.png "$L/" 2>/dev/null ;;  # the figures, not the checkpoints
    # the KDA decode step's kernels alone: the fused kernel per V tile against fla-core's recurrence, CUDA-graph timed
    kdadec) timeout ${T_KDADEC:-120} python3 benchmarks/bench_kda.py --decode --json "$L/bench_kda_decode.json" 2>&1 | tee "$L/bench_kda_decode.log" ;;
    # AttnRes's kernels: the training forward/backward (the backward's column-kernel tiles), the inference row kernel
    attnres) timeout ${T_ATTNRES:-240} python3 benchmarks/bench_attn_res.py --json "$L/bench_attn_res.json" 2>&1 | tee "$L/bench_attn_res.log" ;;
    # the optimiser step of small and medium: Muon's fused passes against their torch-op reference (GPU test first)
    tkern)  timeout ${T_TKERN:-240} bash -c "python3 -m pytest -q -p no:cacheprovider -W ignore tests/ops/test_short_conv.py tests/ops/test_max_logit.py tests/ops/test_linear_ce.py; python3 benchmarks/bench_train_kernels.py ${TKERN_ARGS:-} --json $L/bench_train_kernels.json" 2>&1 | tee "$L/bench_train_kernels.log" ;;
    muon)   timeout ${T_MUON:-150} bash -c "python3 -m pytest -q -p no:cacheprovider -W ignore tests/ops/test_muon_step.py; python3 benchmarks/bench_muon.py --json $L/bench_muon.json" 2>&1 | tee "$L/bench_muon.log" ;;
    kda)    timeout ${T_KDA:-420} python3 benchmarks/bench_kda.py --json "$L/bench_kda.json" 2>&1 | tee "$L/bench_kda.log" ;;
    # the suite checks the distributed logic with the reference KDA kernels (no fla autotuning in every spawned
    # process: that alone outlasted the step's limit); fla's kernels under CP are the flacp step's
    nccl)   K3_TEST_BACKEND=nccl K3_KDA_BACKEND=${K3_KDA_BACKEND:-torch} timeout ${T_NCCL:-420} python3 -m pytest -q -p no:cacheprovider -W ignore -m distributed tests/distributed 2>&1 | tee "$L/nccl_tests.log" ;;
    flacp)  timeout ${T_FLACP:-420} python3 -m pytest -q -s -p no:cacheprovider -W ignore tests/gpu/test_fla_cp.py 2>&1 | tee "$L/fla_cp_test.log" ;;
    kcp)    for r in 1 $NGPU; do timeout ${T_KCP:-300} $TR $r benchmarks/bench_kcp.py --json "$L/bench_kcp_r$r.json" 2>&1 | tee "$L/bench_kcp_r$r.log"; done ;;
    # k3 train --compile per layout (SCALE_ARGS replaces the layouts and steps), the corpus at 3 MB
    scale)  timeout ${T_SCALE:-540} python3 benchmarks/bench_scale.py --gpus $NGPU --data-max-bytes 3000000 ${SCALE_ARGS:---layouts one,graph,dp,ep,cp --steps 10 --warmup 4} --json "$L/bench_scale.json" 2>&1 | tee "$L/bench_scale.log" ;;
    *) echo "unknown step $s (tests serve http router decode train trainc ktrain profile memory cp kda kdadec attnres tkern muon packed quant qdecode post nccl flacp kcp scale)"; exit 2 ;;
  esac
done
tar czf "$OUT/gpu_session.tgz" -C "$OUT" logs && rm -rf "$L"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
(cd "$TORCHINDUCTOR_CACHE_DIR" && tar czf "$OUT/inductor.tgz" . 2>/dev/null)
