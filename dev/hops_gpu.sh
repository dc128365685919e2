#!/usr/bin/env bash
# Issue 36's ablations on one GPU in one call of ~8 minutes: the pairs-and-answers format at 8x the protocol's rows
# (batch 256, 3,000 steps) and the masked format at its own budget, many small runs side by side (each is
# launch-bound, so one GPU holds ~11 of them). Results: OUT/answers.jsonl and OUT/masked.jsonl, logs beside them;
# runs a timeout cut leave their progress in OUT/unfinished.log.
#   bash dev/hops_gpu.sh OUT [LIMIT_SECONDS]
set -u
OUT=${1:?usage: bash dev/hops_gpu.sh OUT [LIMIT_SECONDS]}
LIMIT=${2:-470}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# the CPU protocol's seed-43 control first: the GPU run must climb as the CPU run did (4 hops 0.65 at step 4)
timeout "$LIMIT" "$PY" -m dev.hops_grid --task answers --device "$DEVICE" --jobs 2 --out "$OUT/answers_b32.jsonl" --seeds 43 \
    --runs loop &
timeout "$LIMIT" "$PY" -m dev.hops_grid --task answers --device "$DEVICE" --jobs 7 --out "$OUT/answers.jsonl" \
    --seeds 42,43 --task_extra "--batch 256" --suffix _b256 \
    --runs loop,old_default,old_default+bp2+uniform,old_default+no_detach+uniform,plain2,loop+bp2,old_default+bp2,loop+aggressive &
timeout "$LIMIT" "$PY" -m dev.hops_grid --task masked --device "$DEVICE" --jobs 3 --out "$OUT/masked.jsonl" --seeds 42,43 \
    --runs old_default+bp2+uniform,old_default+no_detach+uniform,old_default+bp2,loop+bp2 &
wait
for f in "$OUT"/*.part*; do [ -e "$f" ] && { echo "== $f"; cat "$f"; }; done > "$OUT/unfinished.log"
rm -f "$OUT"/*.part*
for f in "$OUT"/answers_b32.jsonl "$OUT"/answers.jsonl "$OUT"/masked.jsonl; do
    [ -e "$f" ] && { echo "== $f"; "$PY" -m dev.hops_grid --table "$f"; }
done
