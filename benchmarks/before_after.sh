#!/usr/bin/env bash
# The same `jaxserve bench` command on an earlier revision and on the working tree, alternating, in one machine
# start, each tree with its own step store (docs/performance.md, "Structural pass: before/after"):
#   bash benchmarks/before_after.sh REV throughput   # 1024 x 128/128: cold, cold, cached, cached
#   bash benchmarks/before_after.sh REV latency      # batch 1, 128/128, twice each
# REV's tree is taken with `git archive` (run it where the repository is, or set BEFORE to an unpacked tree).
# Each run's JSON goes to $OUT/NAME.json, its -v log to $OUT/NAME.log.
set -u
rev=${1:?usage: before_after.sh REV throughput|latency}; part=${2:-throughput}
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
AFTER=$PWD
BEFORE=${BEFORE:-$(mktemp -d)}
[ -e "$BEFORE/jaxserve" ] || git archive "$rev" | tar -x -C "$BEFORE" || exit 1
bench() {  # bench TREE NAME ARGS...
  local tree=$1 name=$2; shift 2
  echo "== $name ($tree): jaxserve bench $*"
  (cd "$tree" && PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD JAXSERVE_CACHE=$OUT/cache_$(basename "$tree") \
    timeout 280 python3 -m jaxserve.cli bench "$@" --json -v 2>"$OUT/$name.log" | tee "$OUT/$name.json"; echo)
  grep -E "capacity: KV cache|runner.*warmup|Error" "$OUT/$name.log" | cut -c1-300 | tail -n 3
}
python3 benchmarks/ceilings.py
T=(throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 --output-len 128)
L=(latency --random-weights llama-3.1-8b --batch-size 1 --input-len 128 --output-len 128 --num-iters 3)
case $part in
  throughput) A=("${T[@]}"); names=(before_cold after_cold before_cached after_cached) ;;
  latency) A=("${L[@]}"); names=(before_1 after_1 before_2 after_2) ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
esac
for name in "${names[@]}"; do
  tree=$AFTER; [[ $name == before* ]] && tree=$BEFORE
  bench "$tree" "${part}_$name" "${A[@]}"
done
