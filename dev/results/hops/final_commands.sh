cd /work/main
C="--format text --answers_only 1 --n_symbols 8 --max_hops 4 --n_queries 24 --batch 16 --eval_every 500 --eval_docs 256 --warmup 50 --out /tmp/hx/final/runs.jsonl"
( .venv/bin/python -m dev.hops --name loop --n_loops 0 --n_sup 4 --detach 0 --preset uniform --steps 3000 $C > /tmp/hx/final/loop42.log 2>&1 ) &
( .venv/bin/python -m dev.hops --name plain2 --n_loops 0 --n_sup 1 --steps 3000 $C > /tmp/hx/final/plain2_42.log 2>&1;
  .venv/bin/python -m dev.hops --name trm_default --steps 1000 $C > /tmp/hx/final/trm42.log 2>&1 ) &
wait
