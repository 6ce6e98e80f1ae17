#!/usr/bin/env bash
# The engine figures of docs/performance.md on one NVIDIA GPU (H100 or H200), the Llama-3.1-8B shape with random
# bf16 weights (MODEL=gemma-3-12b etc.: another shape of jaxserve/models/shapes.py for latency, throughput and
# long); each mode fits one 10-minute device call and starts with the card's ceilings (ceilings.py):
#   bash benchmarks/gpu_engine.sh ceilings    # copy TB/s and bf16 matmul TFLOP/s only
#   bash benchmarks/gpu_engine.sh latency     # jaxserve bench latency, batch 1 / 8 / 32, 128/128 (BATCHES="1": one)
#   bash benchmarks/gpu_engine.sh throughput  # jaxserve bench throughput, 1024 x 128/128: cold, cached, sampling
#                                             # (COLD_ONLY=1: the cold run only)
#   bash benchmarks/gpu_engine.sh long        # 512 x 1000/1000, 256 x 2048/128, 512 x 128/2048
#   bash benchmarks/gpu_engine.sh sliding     # 256 x 8192/256 (MODEL=gemma-3-12b), SLIDING=off: with
#                                             # --no-sliding-window-kv (every layer keeps every token's KV)
#   bash benchmarks/gpu_engine.sh moe         # qwen3-30b-a3b (MODEL=mixtral-8x7b etc.): the MoE layer's pieces
#                                             # (moe_layer_profile.py; NO_PROFILE=1: not), then batch 1;
#                                             # moe_throughput: 1024 x 128/128; moe_long: 512 x 1000/1000;
#                                             # moe_fp8: batch 1 and 1024 x 128/128 in FP8 (experts too) + FP8 KV
#   bash benchmarks/gpu_engine.sh fp8         # batch 1 in bf16, FP8 weights + FP8 KV, and --quantize-lm-head;
#                                             # fp8_throughput: 1024 x 128/128 in FP8 weights + FP8 KV;
#                                             # fp8_long: `long`'s three jobs in FP8 weights + FP8 KV;
#                                             # fp8_gemm: fp8_gemm.py's table (the products by layout, ~5 min);
#                                             # fp8_profile: the batch-1 decode step kernel by kernel in bf16 and
#                                             # in FP8 weights + FP8 KV (step_profile.py; BATCHES="1 32": more)
#   bash benchmarks/gpu_engine.sh lora        # batch 1 and 1024 x 128/128 without and with 4 random rank-16 adapters
#                                             # on all seven projections (requests spread over them), then the update
#                                             # of one rank-64 adapter (bench's lora.update_ms; NO_UPDATE=1: not;
#                                             # NO_THROUGHPUT=1: batch 1 and the update only),
#                                             # one 10-minute call; lora_update: the update alone;
#                                             # lora_profile: step_profile.py of batch 1 and 32, without and with
#                                             # 4 rank-16 adapter slots; lora_b1: the batch-1 bench with adapters
#                                             # and its step's profile; lora_delta: the batch-1 step's
#                                             # profile without adapters, with them (XLA's products, the
#                                             # Pallas kernels: --lora-delta pallas; float32: written in float32),
#                                             # then the batch-1 bench; lora_pallas: those three profiles, and
#                                             # the shrink kernel with XLA's expand (--lora-delta shrink);
#                                             # lora_linears: lora_linears.py (the products alone, 5 ways);
#                                             # lora_fold: batch 1's step profiled without adapters, with
#                                             # a folded into the weights (the default), with separate tables,
#                                             # then the rank-64 update folded and separate;
#                                             # lora_pool: batch 1 with adapters at KV pools of
#                                             # 0.9 and 0.8 of free memory and of 16,384 tokens,
#                                             # then the update's parts (experiments/lora_update.py)
#   bash benchmarks/gpu_engine.sh admission   # the two 512-request long jobs with --no-bucket-aware-admission
#   bash benchmarks/gpu_engine.sh client      # host time per step under XLA's TFRT GPU client and jax's default
#                                             # one (client_check.py: same tokens), batch 32 and 1024 x 128/128
#   bash benchmarks/gpu_engine.sh serve       # jaxserve serve under 256 streaming clients (serve_load.py), then
#                                             # the bench on the same engine settings (SERVE_MODE=thread:
#                                             # --engine-thread; INTERVALS="8 1": one server each; NO_BENCH=1)
#   bash benchmarks/gpu_engine.sh profile     # the decode step kernel by kernel against its floors (step_profile.py)
#   bash benchmarks/gpu_engine.sh parity      # greedy tokens of the pallas and xla backends (backend_parity.py)
#   bash benchmarks/gpu_engine.sh kernels     # the attention kernels against their reference (kernel_check.py;
#                                             # HEAD_DIMS=256: those cases only)
# `throughput` starts from an empty compile cache ($JAXSERVE_CACHE/xla removed) so its first run is the cold
# warmup. Results: each bench's JSON in $OUT/NAME.json, its steps in $OUT/NAME.steps.jsonl summarised by
# iteration_summary.py, full logs in $OUT/*.log; `profile` writes $OUT/profile_<name>.{txt,csv,log} and its
# traces under $TRACES (default /tmp/step_profile_traces).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"; MODEL=${MODEL:-llama-3.1-8b}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD JAXSERVE_CACHE=${JAXSERVE_CACHE:-$HOME/.cache/jaxserve}
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
  timeout "$limit" ${BENCH_CMD:-python3 -m jaxserve.cli bench} "$@" --json -v --iteration-log "$OUT/$name.steps.jsonl" \
    2>"$OUT/$name.log" | tee "$OUT/$name.json"; echo
  [ -s "$OUT/$name.steps.jsonl" ] && python3 benchmarks/iteration_summary.py "$OUT/$name.steps.jsonl"
  grep -E "jaxserve.(capacity: KV cache|runner: warmup|runner: decode step on padding|engine: max_batch_size)|Error|error" "$OUT/$name.log" | cut -c1-400 | tail -n 6
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 benchmarks/ceilings.py
case "${1:-}" in
  ceilings) ;;
  profile)
    P=(--shape llama8b --backend pallas --max-seq-len 256 --context 192)
    profile_run b1_c192 200 "${P[@]}" --batch 1
    profile_run b32_c192 200 "${P[@]}" --batch 32
    ;;
  latency)
    for b in ${BATCHES:-1 8 32}; do
      bench_run latency_b$b 170 latency --random-weights $MODEL --batch-size $b --input-len 128 --output-len 128 --num-iters 3
    done
    ;;
  throughput)
    rm -rf "$JAXSERVE_CACHE/xla"
    T=(throughput --random-weights $MODEL --num-requests 1024 --input-len 128 --output-len 128)
    bench_run t1024_cold 240 "${T[@]}"
    [ -n "${COLD_ONLY:-}" ] && exit 0
    bench_run t1024_cached 120 "${T[@]}"
    bench_run t1024_sampling 120 "${T[@]}" --temperature 0.8 --top-p 0.95 --top-k 50 --seed-per-request
    ;;
  long)
    L=(throughput --random-weights $MODEL --max-seq-len 2176)
    bench_run t512_1000_1000 220 "${L[@]}" --num-requests 512 --input-len 1000 --output-len 1000
    bench_run t256_2048_128 120 "${L[@]}" --num-requests 256 --input-len 2048 --output-len 128
    bench_run t512_128_2048 160 "${L[@]}" --num-requests 512 --input-len 128 --output-len 2048
    ;;
  sliding)  # the sliding layers' KV kept at their window (default) or every token's (SLIDING=off), same job
    W=(throughput --random-weights $MODEL --num-requests 256 --input-len 8192 --output-len 256 --max-seq-len 8448)
    [ "${SLIDING:-on}" = off ] && W+=(--no-sliding-window-kv)
    bench_run t256_8192_256_sliding_${SLIDING:-on} 560 "${W[@]}"
    ;;
  moe)  # MODEL=qwen3-30b-a3b by default: the MoE layer piece by piece, batch 1, then 1024 x 128/128
    M=${MODEL/llama-3.1-8b/qwen3-30b-a3b}
    [ -z "${NO_PROFILE:-}" ] && (cd benchmarks && timeout 120 python3 moe_layer_profile.py --tokens 1 8 64 512 4096)
    bench_run moe_b1 230 latency --random-weights $M --batch-size 1 --input-len 128 --output-len 128 --num-iters 3
    ;;
  moe_throughput)  # 1024 x 128/128 of the MoE shape: its warmup compiles 40 steps of ~30 s each (an H100, 8 threads)
    M=${MODEL/llama-3.1-8b/qwen3-30b-a3b}
    bench_run moe_t1024 560 throughput --random-weights $M --num-requests 1024 --input-len 128 --output-len 128
    ;;
  moe_fp8)  # the MoE shape with FP8 weights (linears and expert stacks: ~31 GB for qwen3-30b-a3b) and FP8 KV
    M=${MODEL/llama-3.1-8b/qwen3-30b-a3b}
    F=(--quantization fp8 --kv-cache-dtype fp8)
    bench_run moe_b1_fp8 230 latency --random-weights $M --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 "${F[@]}"
    bench_run moe_t1024_fp8 300 throughput --random-weights $M --num-requests 1024 --input-len 128 --output-len 128 "${F[@]}"
    ;;
  moe_long)  # 512 x 1000/1000 of the MoE shape
    M=${MODEL/llama-3.1-8b/qwen3-30b-a3b}
    bench_run moe_t512_1000_1000 560 throughput --random-weights $M --num-requests 512 --input-len 1000 --output-len 1000 --max-seq-len 2176
    ;;
  fp8_gemm)  # the FP8 products against bf16 at the 8B's shapes, by weight layout and output type
    (cd benchmarks && timeout 560 python3 fp8_gemm.py)
    ;;
  fp8)  # batch 1 in bf16, in FP8 (weights + KV) and with the lm_head in FP8 too, same start
    B1=(latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 128 --num-iters 3)
    bench_run latency_b1_bf16 150 "${B1[@]}"
    bench_run latency_b1_fp8 150 "${B1[@]}" --quantization fp8 --kv-cache-dtype fp8
    bench_run latency_b1_fp8_head 150 "${B1[@]}" --quantization fp8 --kv-cache-dtype fp8 --quantize-lm-head
    ;;
  fp8_profile)  # the decode step kernel by kernel, bf16 then FP8 weights + FP8 KV, per batch size
    P=(--shape llama8b --backend pallas --max-seq-len 256 --context 192)
    for b in ${BATCHES:-1}; do
      profile_run b${b}_c192 120 "${P[@]}" --batch $b
      profile_run b${b}_c192_fp8 120 "${P[@]}" --batch $b --quantization fp8 --kv-cache-dtype fp8
    done
    ;;
  fp8_throughput)  # 1024 x 128/128 with FP8 weights and KV (the bf16 figure: `throughput` on the same start)
    bench_run t1024_fp8 400 throughput --random-weights $MODEL --num-requests 1024 --input-len 128 --output-len 128 --quantization fp8 --kv-cache-dtype fp8
    ;;
  fp8_long)  # `long`'s three jobs with FP8 weights and KV
    L=(throughput --random-weights $MODEL --max-seq-len 2176 --quantization fp8 --kv-cache-dtype fp8)
    bench_run t512_1000_1000_fp8 220 "${L[@]}" --num-requests 512 --input-len 1000 --output-len 1000
    bench_run t256_2048_128_fp8 120 "${L[@]}" --num-requests 256 --input-len 2048 --output-len 128
    bench_run t512_128_2048_fp8 180 "${L[@]}" --num-requests 512 --input-len 128 --output-len 2048
    ;;
  lora)  # the base model and 4 adapters of rank 16, same start (the bf16 figures the targets compare against)
    T=(throughput --random-weights $MODEL --num-requests 1024 --input-len 128 --output-len 128)
    B1=(latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 128 --num-iters 3)
    bench_run latency_b1_base 80 "${B1[@]}"
    bench_run latency_b1_lora4 170 "${B1[@]}" --lora-adapters 4 --max-lora-rank 16
    if [ -z "${NO_THROUGHPUT:-}" ]; then
      bench_run t1024_base 140 "${T[@]}"
      bench_run t1024_lora4 160 "${T[@]}" --lora-adapters 4 --max-lora-rank 16
    fi
    [ -z "${NO_UPDATE:-}" ] && bench_run latency_b1_lora_r64 150 latency --random-weights $MODEL --batch-size 1 \
      --input-len 128 --output-len 16 --num-iters 1 --lora-adapters 1 --max-lora-rank 64
    ;;
  lora_b1)  # batch 1 with 4 rank-16 adapters, then its decode step kernel by kernel (step_profile.py)
    bench_run latency_b1_lora4 170 latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 128 \
      --num-iters 3 --lora-adapters 4 --max-lora-rank 16
    profile_run b1_c192_lora4 150 --shape llama8b --backend pallas --max-seq-len 256 --context 192 --batch 1 \
      --lora-adapters 4 --max-lora-rank 16
    ;;
  lora_delta)  # the batch-1 decode step kernel by kernel: no adapters, 4 rank-16 slots (XLA's products, the Pallas
    # kernels), the batch-1 bench, then XLA's products written in float32 (last: the first cut if the call runs long)
    P=(--shape llama8b --backend pallas --max-seq-len 256 --context 192 --batch 1)
    profile_run b1_c192 120 "${P[@]}"
    profile_run b1_c192_lora4 130 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta xla
    profile_run b1_c192_lora4_pallas 130 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta pallas
    bench_run latency_b1_lora4 170 latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 128 \
      --num-iters 3 --lora-adapters 4 --max-lora-rank 16
    profile_run b1_c192_lora4_f32 130 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta float32
    ;;
  lora_pallas)  # the batch-1 decode step kernel by kernel: no adapters, XLA's products, the Pallas kernels, the shrink
    # kernel with XLA's expand
    P=(--shape llama8b --backend pallas --max-seq-len 256 --context 192 --batch 1)
    profile_run b1_c192 90 "${P[@]}"
    profile_run b1_c192_lora4 90 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta xla
    profile_run b1_c192_lora4_pallas 90 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta pallas
    profile_run b1_c192_lora4_shrink 90 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta shrink
    ;;
  lora_linears)  # the adapters' products by way of computing them, on the 8B shape's 32 layers of linears alone
    # (lora_linears.py: XLA's, x @ a split over K by hand, the Pallas shrink, a folded into the base weight)
    timeout 300 python3 benchmarks/lora_linears.py --rows 1,8,32 2>"$OUT/lora_linears.log" | tee "$OUT/lora_linears.txt"
    grep -E "Error|error" "$OUT/lora_linears.log" | cut -c1-220 | tail -n 14
    ;;
  lora_profile)  # the batch-1 and batch-32 decode steps kernel by kernel, without and with 4 rank-16 adapter slots
    P=(--shape llama8b --backend pallas --max-seq-len 256 --context 192)
    for b in 1 32; do
      profile_run b${b}_c192 150 "${P[@]}" --batch $b
      profile_run b${b}_c192_lora4 150 "${P[@]}" --batch $b --lora-adapters 4 --max-lora-rank 16
    done
    ;;
  lora_fold)  # the batch-1 decode step kernel by kernel: no adapters, 4 rank-16 slots folded into the weights (the
    # engine's default on one device), separate tables (XLA's products); then the update of a rank-64 adapter folded
    # and separate (experiments/lora_fold.py)
    P=(--shape llama8b --backend pallas --max-seq-len 256 --context 192 --batch 1)
    profile_run b1_c192 90 "${P[@]}"
    profile_run b1_c192_lora4_fold 100 "${P[@]}" --lora-adapters 4 --max-lora-rank 16
    profile_run b1_c192_lora4_xla 100 "${P[@]}" --lora-adapters 4 --max-lora-rank 16 --lora-delta xla
    U=(latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 16 --num-iters 1 --lora-adapters 1 --max-lora-rank 64)
    for how in fold separate; do
      BENCH_CMD="python3 benchmarks/experiments/lora_fold.py $how" bench_run lora_r64_$how 150 "${U[@]}"
    done
    ;;
  lora_pool)  # batch 1 with 4 rank-16 adapters, the KV pool from device memory at two free-memory fractions and
    # capped at 16,384 tokens; then the rank-64 update's parts, folded and separate (experiments/lora_update.py)
    B1=(latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 --lora-adapters 4 --max-lora-rank 16)
    bench_run latency_b1_lora4_f09 150 "${B1[@]}" --kv-cache-free-memory-fraction 0.9
    bench_run latency_b1_lora4_f08 150 "${B1[@]}" --kv-cache-free-memory-fraction 0.8
    bench_run latency_b1_lora4_cap16k 150 "${B1[@]}" --kv-cache-max-tokens 16384
    timeout 150 python3 benchmarks/experiments/lora_update.py --model $MODEL --rank 64 2>"$OUT/lora_update.log" | tee "$OUT/lora_update.txt"
    ;;
  lora_update)  # one rank-64 adapter on all seven projections: its update_lora time (lora.update_ms)
    bench_run latency_b1_lora_r64 200 latency --random-weights $MODEL --batch-size 1 --input-len 128 --output-len 16 --num-iters 1 --lora-adapters 1 --max-lora-rank 64
    ;;
  admission)  # against `long` on the same machine start
    A=(throughput --random-weights llama-3.1-8b --max-seq-len 2176 --no-bucket-aware-admission)
    bench_run t512_1000_1000_uncapped 220 "${A[@]}" --num-requests 512 --input-len 1000 --output-len 1000
    bench_run t512_128_2048_uncapped 160 "${A[@]}" --num-requests 512 --input-len 128 --output-len 2048
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
  kernels) timeout 300 python3 benchmarks/kernel_check.py --head-dims "${HEAD_DIMS:-128,256}" ;;
  parity)  # SmolLM2-135M-Instruct, real weights (fetched into ~/.cache/jaxserve on first use), float32
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout 500 python3 benchmarks/backend_parity.py --dtype float32 \
      2>"$OUT/parity.log" | tee "$OUT/parity.json"
    ;;
  *) echo "usage: $0 ceilings|latency|throughput|long|sliding|moe|moe_fp8|moe_long|fp8|fp8_throughput|fp8_gemm|lora|lora_b1|lora_fold|lora_update|lora_profile|admission|client|serve|profile|parity|kernels" >&2; exit 2 ;;
esac
