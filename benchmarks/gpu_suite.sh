#!/usr/bin/env bash
# The GPU benchmark suite: for each model, `bench engine` (the nano-vllm shape: 256 sequences,
# input and output lengths uniform in 100..1024) and `bench serve` through the whole Ray Serve
# app (random 128-token prompts, 128 output tokens, ignore_eos) at 32 and 256 concurrent
# streams. Results land in $OUT (default ./gpu-results) as JSON plus the printed tables.
#
#   OUT=/tmp/gpu benchmarks/gpu_suite.sh [MODEL ...]   (default: bench-135m and bench-1b)
# SERVE_ARGS adds `shardserve serve` flags (e.g. "--config more-ingress.yaml"), ENGINE_ARGS
# `bench engine` flags (async scheduling is off by default: "--async-scheduling" gives the
# engine that schedules each step while the one before it runs, for an A/B); SKIP_ENGINE=1
# runs only the served load; CONCURRENCY (default "32 256") the stream counts.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CLI=("$PY" -m serve_app.cli)
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(shardserve/bench-135m shardserve/bench-1b)
port=${PORT:-8123}

for model in "${models[@]}"; do
  name=$(basename "$model")
  if [ -z "${SKIP_ENGINE:-}" ]; then
    echo "=== bench engine $model"
    timeout 600 "${CLI[@]}" bench engine --model "$model" --kv-cache-gib 16 ${ENGINE_ARGS:-} \
      --result-json "$OUT/engine-$name.json" > "$OUT/engine-$name.txt" 2>&1
    grep -E "output_tokens_per_s|decode_only_step_ms|roofline_decode|elapsed_s|device" \
      "$OUT/engine-$name.txt"
  fi

  echo "=== bench serve $model"
  "${CLI[@]}" serve --model "$model" --port "$port" --max-num-seqs 256 --kv-cache-gib 16 \
    --max-num-batched-tokens 8192 ${SERVE_ARGS:-} > "$OUT/serve-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 180); do
    grep -q "shardserve: serving" "$OUT/serve-$name.log" && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  if ! grep -q "shardserve: serving" "$OUT/serve-$name.log"; then
    echo "server did not start:"; tail -30 "$OUT/serve-$name.log"; kill $server; continue
  fi
  for c in ${CONCURRENCY:-32 256}; do
    timeout 300 "${CLI[@]}" bench serve --base-url "http://127.0.0.1:$port" --model "$model" \
      --dataset-name random --random-input-len 128 --random-output-len 128 --ignore-eos \
      --max-concurrency $c --num-prompts $((c * 4)) --num-warmups 8 \
      --tokenizer replicas/embedded --result-json "$OUT/serve-$name-c$c.json" \
      > "$OUT/serve-$name-c$c.txt" 2>&1
    echo "--- concurrency $c"
    grep -E "Output token throughput|Median TTFT|Median TPOT|Failed|Successful" \
      "$OUT/serve-$name-c$c.txt"
  done
  kill -TERM $server
  for _ in $(seq 60); do kill -0 $server 2>/dev/null || break; sleep 1; done
  kill -9 $server 2>/dev/null
  wait $server 2>/dev/null
done
