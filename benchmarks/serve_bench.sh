#!/usr/bin/env bash
# Serving benchmarks on the GPU machine: `slipstream serve` (dummy weights) driven by
# `slipstream bench serve` on loopback, in one call.
#   bash benchmarks/serve_bench.sh small OUT [STREAM_INTERVAL]   small-256 at concurrency 256
#     (prefix caching off: its random prompts share nothing, and the measured pass repeats
#     the warm-up's prompts, which the cache would otherwise serve)
#   bash benchmarks/serve_bench.sh latency OUT [--no-async-scheduling]   seed-8b shape, c = 1,8,32,64
#   bash benchmarks/serve_bench.sh dp OUT N [SERVER FLAGS]   small-256 at concurrency 256 on
#     `serve --data-parallel-size N` (e.g. N=2 --gpu-memory-utilization 0.45: two replicas on one GPU)
#   bash benchmarks/serve_bench.sh dp-cpu OUT N   the same on the CPU: the embedded SmolLM2,
#     random prompts of 32 tokens, 16 out, 16 requests at concurrency 8
set -uo pipefail
kind=$1 out=$2; shift 2
mkdir -p "$out"
CONFIGS=$(python3 -c "import slipstream.bench.workloads as w; print(w.CONFIGS)")
PORT=${PORT:-8011}

start_server() {  # start_server LOG ARGS...
  local log=$1; shift
  python3 -m slipstream.cli serve --port "$PORT" --load-format dummy "$@" >"$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 "${WAIT_HALF_S:-240}"); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && return 0
    kill -0 $SERVER 2>/dev/null || { echo "server died:"; tail -20 "$log"; return 1; }
    sleep 0.5
  done
  echo "server did not start in $(( ${WAIT_HALF_S:-240} / 2 )) s"; tail -20 "$log"; return 1
}

stop_server() {
  kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
}

small256_passes() {  # small256_passes RESULT_JSON METRICS: small-256 at concurrency 256 against the server
  # a first pass warms the kernels (as the offline bench's warm-up does); the second is measured
  python3 -m slipstream.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset small-256 \
    --max-concurrency 256 --ignore-eos --num-workers 4 --disable-tqdm | grep -E "Output token|duration"
  python3 -m slipstream.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset small-256 \
    --max-concurrency 256 --ignore-eos --num-workers 4 --disable-tqdm --save-result --result-file "$1"
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
    | grep -E "^slipstream:($2)" | head
}

case $kind in
  small)
    si=${1:-1}
    start_server "$out/server-small-si$si.log" --model "$CONFIGS/qwen3-0.6b" --max-model-len 2048 \
      --max-num-seqs 256 --stream-interval "$si" --no-prefix-caching || exit 1
    small256_passes "$out/serve-small-si$si.json" "generation_tokens|prompt_tokens|request_success"
    stop_server ;;
  latency)
    mode=${1:-}
    tag=$([ -n "$mode" ] && echo sync || echo async)
    start_server "$out/server-8b-$tag.log" --model "$CONFIGS/llama-3.1-8b" --max-model-len 2048 \
      --max-num-seqs 64 $mode || exit 1
    python3 -m slipstream.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset random \
      --random-input-len 256 --random-output-len 64 --num-prompts 64 --max-concurrency 64 --ignore-eos \
      --disable-tqdm | grep -E "Output token|duration"  # warm-up
    python3 -m slipstream.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset random \
      --random-input-len 256 --random-output-len 256 --ignore-eos --concurrency 1,8,32,64 \
      --prompts-per-concurrency 2 --disable-tqdm --save-result --result-file "$out/serve-8b-$tag.json" \
      --plot "$out/serve-8b-$tag.png"
    stop_server ;;
  dp)
    n=$1; shift
    WAIT_HALF_S=960 start_server "$out/server-dp$n.log" --model "$CONFIGS/qwen3-0.6b" --max-model-len 2048 \
      --max-num-seqs 256 --no-prefix-caching --data-parallel-size "$n" "$@" || exit 1
    small256_passes "$out/serve-dp$n.json" "replica_requests_routed|replica_kv_blocks_total|kv_blocks_total|generation_tokens"
    stop_server ;;
  dp-cpu)
    n=$1
    start_server "$out/server-dp-cpu$n.log" --load-format auto --device cpu --max-model-len 512 \
      --max-num-seqs 8 --data-parallel-size "$n" || exit 1
    python3 -m slipstream.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset random \
      --random-input-len 32 --random-output-len 16 --num-prompts 16 --max-concurrency 8 --ignore-eos \
      --disable-tqdm --save-result --result-file "$out/serve-dp-cpu$n.json"
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
      | grep -E "^slipstream:replica_requests_routed" | head
    stop_server ;;
esac
