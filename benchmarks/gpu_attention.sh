#!/usr/bin/env bash
# The attention kernels' figures of docs/performance.md (and docs/kernels.md) on one NVIDIA GPU (H100 or H200),
# with Nsight Compute (`ncu`); each part fits one 10-minute device call:
#   bash benchmarks/gpu_attention.sh table    # ceilings and every table case (device time, then wall time)
#   bash benchmarks/gpu_attention.sh cases "sweep,prefill"  # device times of the cases named (and the ceilings);
#                                                          # "sweep": the tilings behind jaxserve/kernels/tuning.py
# Outputs: $OUT/*.csv (ncu), $OUT/*.txt (summaries).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
cd benchmarks
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
NCU=(ncu --clock-control none --metrics gpu__time_duration.sum --csv)
device_times() {  # device_times NAME ONLY [ARGS]: ncu over the cases matching ONLY, then the per-case summary
  "${NCU[@]}" python3 attention_kernels.py --mode ncu --only "$2" "${@:3}" >"$OUT/$1.csv" 2>"$OUT/$1.err"
  grep -E "FAILED|Error" "$OUT/$1.err" | cut -c1-300
  python3 attention_kernels.py --summarize "$OUT/$1.csv" | tee "$OUT/$1.txt"
}
case "${1:-}" in
  cases)
    device_times cases "ceiling,empty,${2:?cases needs a comma-separated list of case-name parts}"
    ;;
  table)
    device_times table "ceiling,empty,decode,prefill,mixed" --skip sweep
    python3 attention_kernels.py --mode time --only "ceiling,decode,prefill,mixed" --skip sweep | tee "$OUT/wall.txt"
    ;;
  *) echo "usage: $0 cases ONLY|table" >&2; exit 2 ;;
esac
