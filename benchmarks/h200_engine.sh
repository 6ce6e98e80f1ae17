#!/usr/bin/env bash
# The engine figures of docs/benchmarks.md on one H200, in two parts (each fits one device call):
#   bash benchmarks/h200_engine.sh llama8b   # ceilings, then the Llama-3.1-8B-shaped model (cold, then cached warmup)
#   bash benchmarks/h200_engine.sh smollm2   # SmolLM2: pallas cold + cached warmup, then xla, token comparison
#   bash benchmarks/h200_engine.sh dispatch  # which ops make the step call block the host (dispatch_sync.py)
#   bash benchmarks/h200_engine.sh tp2       # 8B-shaped on two GPUs: Pallas kernels under shard_map, and xla
#   bash benchmarks/h200_engine.sh profile   # 8B-shaped decode step, kernel by kernel against its floors (step_profile.py)
#   bash benchmarks/h200_engine.sh latency   # jaxserve bench latency, 8B shape, batch 1 / 8 / 32 (default settings)
#   bash benchmarks/h200_engine.sh throughput  # jaxserve bench throughput, 1024 x 128/128: cold, cached, sampling
#   bash benchmarks/h200_engine.sh long      # jaxserve bench throughput: 512 x 1000/1000, 256 x 2048/128, 512 x 128/2048
#   bash benchmarks/h200_engine.sh admission # ceilings, the long jobs with bucket-aware admission (the default), the two 512-request ones without
#   bash benchmarks/h200_engine.sh client    # XLA's StreamExecutor against its TFRT GPU client: tokens and hand-back paths
#                                            # (client_check.py), then batch 32 and 1024 x 128/128 under each, interleaved
#   bash benchmarks/h200_engine.sh cmdbuf    # 1024 x 128/128 with XLA's command-buffer log: what its CUDA-graph updates cost
#   bash benchmarks/h200_engine.sh serve     # jaxserve serve under 256 streaming clients (--stream-interval 8, 1), then bench on the same engine settings
#                                            # (SERVE_MODE=thread: --engine-thread; INTERVALS="8": one run; NO_BENCH=1: no bench)
# `latency`, `throughput` and `long` each fit one device call; `throughput` starts from an empty cache
# ($JAXSERVE_CACHE/xla removed) so its first run is the cold warmup.
# Results: one JSON line per run in $OUT/results.jsonl (stdout), full logs in $OUT/*.log; `profile` writes
# $OUT/profile_<name>.{txt,csv,json,log} per run and its traces under $TRACES (default /tmp/step_profile_traces).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD JAXSERVE_CACHE=${JAXSERVE_CACHE:-$HOME/.cache/jaxserve}
run() {  # run NAME TIMEOUT ARGS...: one benchmark process, its JSON line to results, its log kept
  local name=$1 limit=$2; shift 2
  echo "== $name: python benchmarks/engine.py $*"
  timeout "$limit" python3 benchmarks/engine.py "$@" 2>"$OUT/$name.log" | tee -a "$OUT/results.jsonl"
  grep -E "jaxserve.(capacity|runner: warmup)|Error|error" "$OUT/$name.log" | cut -c1-220 | tail -n 14
}
profile_run() {  # profile_run NAME TIMEOUT ARGS...: one step_profile.py process, its table kept
  local name=$1 limit=$2; shift 2
  echo "== $name: python benchmarks/step_profile.py $*"
  timeout "$limit" python3 benchmarks/step_profile.py "$@" --out "$OUT/profile_$name.csv" \
    --trace-dir "${TRACES:-/tmp/step_profile_traces}/$name" 2>"$OUT/profile_$name.log" | tee "$OUT/profile_$name.txt"
  grep -E "Error|error" "$OUT/profile_$name.log" | cut -c1-220 | tail -n 14
}
bench_run() {  # bench_run NAME TIMEOUT ARGS...: one `jaxserve bench` process (-v log kept), its JSON to $OUT/NAME.json,
  # its steps to $OUT/NAME.steps.jsonl and their host time by kind of step (iteration_summary.py) to stdout
  local name=$1 limit=$2; shift 2
  echo "== $name: jaxserve bench $*"
  timeout "$limit" python3 -m jaxserve.cli bench "$@" --json -v --iteration-log "$OUT/$name.steps.jsonl" \
    2>"$OUT/$name.log" | tee "$OUT/$name.json"; echo
  [ -s "$OUT/$name.steps.jsonl" ] && python3 benchmarks/iteration_summary.py "$OUT/$name.steps.jsonl"
  grep -E "jaxserve.(capacity: KV cache|runner: warmup|runner: decode step on padding|engine: max_batch_size)|Error|error" "$OUT/$name.log" | cut -c1-400 | tail -n 6
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
case "${1:-}" in
  llama8b)
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from attention import ceilings; print('CEILINGS', ceilings())"
    L=(--model llama8b --backend pallas --max-seq-len 2048 --decode-sizes 64,128,256 --token-buckets 2048,8192)
    run llama8b_cold 330 "${L[@]}" --num-prompts 256 --prompt-len 128 --max-tokens 128
    run llama8b_cached 150 "${L[@]}" --num-prompts 64 --prompt-len 128 --max-tokens 16
    ;;
  smollm2)
    S=(--model smollm2 --max-seq-len 256 --max-batch-size 256 --num-prompts 256 --prompt-len 128 --max-tokens 128)
    run smollm2_pallas_cold 200 "${S[@]}" --backend pallas --save-tokens "$OUT/pallas_tokens.npy"
    run smollm2_pallas_cached 100 "${S[@]}" --backend pallas
    run smollm2_xla 200 "${S[@]}" --backend xla --compare-tokens "$OUT/pallas_tokens.npy"
    ;;
  tp2)
    T=(--model llama8b --max-seq-len 2048 --decode-sizes 64,128,256 --token-buckets 2048,8192 --tp 2)
    T+=(--num-prompts 256 --prompt-len 128 --max-tokens 128)
    run llama8b_tp2_pallas 280 "${T[@]}" --backend pallas
    run llama8b_tp2_xla 280 "${T[@]}" --backend xla --max-tokens 32
    ;;
  dispatch)
    echo "== python benchmarks/dispatch_sync.py"
    timeout 300 python3 benchmarks/dispatch_sync.py | tee "$OUT/dispatch_sync.txt"
    ;;
  profile)
    P=(--shape llama8b --backend pallas --max-seq-len 2048)
    profile_run b1_c128 200 "${P[@]}" --batch 1 --context 128
    profile_run b256_c192 280 "${P[@]}" --batch 256 --context 192 --variant greedy,candidates,sorted
    ;;
  latency)
    for b in 1 8 32; do
      bench_run latency_b$b 170 latency --random-weights llama-3.1-8b --batch-size $b --input-len 128 --output-len 128 --num-iters 3
    done
    ;;
  throughput)
    rm -rf "$JAXSERVE_CACHE/xla"
    T=(throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 --output-len 128)
    bench_run t1024_cold 240 "${T[@]}"
    bench_run t1024_cached 120 "${T[@]}"
    bench_run t1024_sampling 120 "${T[@]}" --temperature 0.8 --top-p 0.95 --top-k 50 --seed-per-request
    ;;
  long)
    L=(throughput --random-weights llama-3.1-8b --max-seq-len 2176)
    bench_run t512_1000_1000 220 "${L[@]}" --num-requests 512 --input-len 1000 --output-len 1000
    bench_run t256_2048_128 120 "${L[@]}" --num-requests 256 --input-len 2048 --output-len 128
    bench_run t512_128_2048 160 "${L[@]}" --num-requests 512 --input-len 128 --output-len 2048
    ;;
  admission)  # the long jobs with bucket-aware admission (the default), then the two 512-request ones without
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from attention import ceilings; print('CEILINGS', ceilings())"
    A=(throughput --random-weights llama-3.1-8b --max-seq-len 2176)
    bench_run t512_1000_1000 220 "${A[@]}" --num-requests 512 --input-len 1000 --output-len 1000
    bench_run t512_128_2048 160 "${A[@]}" --num-requests 512 --input-len 128 --output-len 2048
    bench_run t256_2048_128 120 "${A[@]}" --num-requests 256 --input-len 2048 --output-len 128
    bench_run t512_1000_1000_uncapped 160 "${A[@]}" --num-requests 512 --input-len 1000 --output-len 1000 --no-bucket-aware-admission
    bench_run t512_128_2048_uncapped 160 "${A[@]}" --num-requests 512 --input-len 128 --output-len 2048 --no-bucket-aware-admission
    ;;
  client)  # the variable is read when jax starts its backend: each process below gets its own client
    E=XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT
    env $E=0 timeout 150 python3 benchmarks/client_check.py --shape smollm2-135m --save "$OUT/client_tokens.npy" 2>/dev/null
    env $E=1 timeout 150 python3 benchmarks/client_check.py --shape smollm2-135m --compare "$OUT/client_tokens.npy" 2>/dev/null
    L=(latency --random-weights llama-3.1-8b --batch-size 32 --input-len 128 --output-len 128 --num-iters 3)
    i=0; for t in 1 0 1 0; do i=$((i + 1)); export "$E=$t"; bench_run latency_b32_client$t.$i 170 "${L[@]}"; done
    T=(throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 --output-len 128)
    for t in 1 0 1; do i=$((i + 1)); export "$E=$t"; bench_run t1024_client$t.$i 240 "${T[@]}"; done
    unset "$E"
    ;;
  cmdbuf)  # XLA's own log of every CUDA-graph update (commands re-recorded, allocations moved, microseconds);
    # on the StreamExecutor client, as docs/benchmarks.md measured it, unless the variable says otherwise
    export XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=${XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT:-0}
    T=(throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 --output-len 128)
    for name in greedy sampling; do
      extra=(); [ $name = sampling ] && extra=(--temperature 0.8 --top-p 0.95 --top-k 50 --seed-per-request)
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1 \
        bench_run cmdbuf_$name 240 "${T[@]}" "${extra[@]}"
      python3 benchmarks/command_buffer_log.py "$OUT/cmdbuf_$name.log" --after "runner: warmup"
    done
    ;;
  serve)  # SERVE_MODE=thread: the engine in a thread of the server process (--engine-thread); PASSES load runs per server
    S=(--random-weights llama-3.1-8b --served-model-name llama-3.1-8b --port 8000 --max-batch-size 256 --max-seq-len 256 --no-penalty-variants -v)
    [ "${SERVE_MODE:-process}" = thread ] && S+=(--engine-thread)
    C=(--model llama-3.1-8b --num-clients 256 --num-requests 1024 --input-len 128 --output-len 128 --processes 4 --json)
    for interval in ${INTERVALS:-8 1}; do
      echo "== jaxserve serve ${S[*]} --stream-interval $interval; python benchmarks/serve_load.py ${C[*]}"
      python3 -m jaxserve.cli serve "${S[@]}" --stream-interval "$interval" >/dev/null 2>"$OUT/serve_$interval.log" &
      server=$!
      for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
      for pass in $(seq 1 "${PASSES:-1}"); do
        echo "pass $pass (prompts of --seed $pass: a later pass finds none of an earlier one's in the prefix cache)"
        timeout 120 python3 benchmarks/serve_load.py "${C[@]}" --seed "$pass" | tee -a "$OUT/results.jsonl"
        curl -s http://127.0.0.1:8000/metrics | grep -E "^jaxserve:time_per_output_token_seconds_(sum|count)"
      done
      kill -INT $server; wait $server
      grep -E "engine loop:" "$OUT/serve_$interval.log"
    done
    B=(throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 --output-len 128 --max-batch-size 256)
    [ -n "${NO_BENCH:-}" ] || bench_run t1024_at_256 120 "${B[@]}"
    [ -n "${NO_BENCH:-}" ] || bench_run t1024_at_256_c256 120 "${B[@]}" --max-concurrency 256  # the clients' closed loop
    ;;
  *) echo "usage: $0 llama8b|smollm2|dispatch|tp2|profile|latency|throughput|long|admission|serve" >&2; exit 2 ;;
esac
