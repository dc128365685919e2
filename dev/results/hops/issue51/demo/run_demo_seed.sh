#!/usr/bin/env bash
# One recursion (or plain) run of dev/runcpu_hops.sh's base_train, alone on one core, evaluated to 4N (issue 51).
# usage: NAME=new SEED=42 bash run_demo_seed.sh [base_train flags...]   (NANOCHAT_BASE_DIR holds the corpus)
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
py=.venv/bin/python
tag="hops_${NAME}_s$SEED"
start=$(date +%s)
OMP_NUM_THREADS=1 $py -m scripts.base_train --device_type=cpu --depth=1 --n_embd=64 --n_head=2 --max_seq_len=105 \
    --rows=documents --device_batch_size=32 --total_batch_size=3360 --num_iterations="${STEPS:-1000}" \
    --warmup_steps=20 --warmdown_ratio=0.3 --matrix_lr=0.02 --embedding_lr=0.2 --unembedding_lr=0.004 --ema_decay=0 \
    --eval_every=250 --eval_tokens=8192 --sample_every=0 --save_every=250 --keep_last=1 --seed="$SEED" \
    --model_tag="$tag" "$@" > "$NANOCHAT_BASE_DIR/$tag.log" 2>&1
train_s=$(( $(date +%s) - start ))
OMP_NUM_THREADS=1 $py -m scripts.base_loss --device_type=cpu --model_tag="$tag" --hops --hops_docs=1000 \
    --n_sup="${EVAL_N_SUP:-16}" > "$NANOCHAT_BASE_DIR/$tag.eval.log" 2>&1
echo "$tag trained in $train_s s"
