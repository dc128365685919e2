#!/bin/bash
# before (branch point ea4b9dd) and after (this branch), back to back, twice
for round in 1 2; do
  for side in before after; do
    dir=/tmp/trm_before; [ $side = after ] && dir=/work/wt/52
    echo "=== round $round $side ($dir) $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $dir && timeout 1200 /work/wt/52/.venv/bin/python -m dev.bench_train_step --nanochat_dir /tmp/nanochat_head --configs plain --steps 11 2>&1 | tail -7)
  done
done
