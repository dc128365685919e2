#!/usr/bin/env bash
# Does the recursion use its depth? On a CPU with no network, through the product's scripts: the hops corpus
# (7-symbol cycles, 1-3 hops, earlier answers in the text) -> a byte-level tokenizer -> base_train of gpt.py's default
# recursion and of the plain model of the same block, side by side on one core each -> base_loss --hops -> one plot of
# the 3-hop accuracy at every supervision step. 7 symbols, not 6: at 6 (120 possible cycles) the plain block answered
# 3 hops at 1.00 in one pass; at 7 it reached 0.26 (seed 42) where the recursion climbed from 0.16 at step 1 to 1.00 at
# step 2. Not every seed leaves the loss plateau in 1,000 steps: of seeds 42-46 the recursion climbs on 42, 44 and 46;
# on 43 and 45 it learns no multi-hop lookup (the plot's step prints a WARNING then).
# Times and results: dev/LOG.md (issues 36 and 51), dev/results/hops/demo7/ and dev/results/hops/issue51/demo/.
# Everything lands in $NANOCHAT_BASE_DIR (default ~/.cache/nanochat-hops); STEPS=N trains longer or shorter, SEED=N
# draws other initial weights (the tags and the plot carry it).
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat-hops}"
STEPS="${STEPS:-1000}"
SEED="${SEED:-42}"
trm="hops_trm_s$SEED" plain="hops_plain_s$SEED"
start=$(date +%s)

echo "== 1/5 environment"
bash dev/setup_env.sh plot
py=.venv/bin/python

echo "== 2/5 the hops corpus and a byte-level tokenizer (each answer one token, scored by exact match)"
$py -m nanochat.dataset --synthetic=hops_pairs --hops_symbols=7 --hops_max=3 --synthetic_docs=60000
if [ ! -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ]; then
    $py -m scripts.tok_train --byte_level
fi

echo "== 3/5 train the default recursion (1 block) and the plain block beside it, $STEPS steps each"
# One block of width 64; the plain model is the same block run once (n_loops 0, one supervision step). The learning
# rates are those of dev/hops.py's lookups. A tag that has checkpoints continues (--resume) instead of refusing.
train() {
    local tag=$1; shift
    local resume=""
    if compgen -G "$NANOCHAT_BASE_DIR/base_checkpoints/$tag/step_*" > /dev/null; then resume="--resume"; fi
    # --max_seq_len=105: rows of 106 tokens, each one whole document (<|bos|> + 105 characters), as dev/hops.py
    # trains; rows of 129 tokens cut documents across rows and kept the recursion on the plateau (issue 36)
    OMP_NUM_THREADS=1 $py -m scripts.base_train --device_type=cpu --depth=1 --n_embd=64 --n_head=2 --max_seq_len=105 --rows=documents \
        --device_batch_size=32 --total_batch_size=3360 --num_iterations="$STEPS" --warmup_steps=20 \
        --warmdown_ratio=0.3 --matrix_lr=0.02 --embedding_lr=0.2 --unembedding_lr=0.004 --ema_decay=0 \
        --eval_every=250 --eval_tokens=8192 --sample_every=0 --save_every=250 --keep_last=1 \
        --seed="$SEED" --model_tag="$tag" ${resume:+"$resume"} "$@" > "$NANOCHAT_BASE_DIR/$tag.log" 2>&1 \
        || { echo "base_train $tag failed: see $NANOCHAT_BASE_DIR/$tag.log" >&2; return 1; }
}
train "$trm" &
trm_pid=$!
train "$plain" --n_loops=0 --n_sup_train=1 &
plain_pid=$!
if ! wait $trm_pid; then kill $plain_pid 2>/dev/null; exit 1; fi
wait $plain_pid
tail -n 1 "$NANOCHAT_BASE_DIR/$trm.log" "$NANOCHAT_BASE_DIR/$plain.log"

echo "== 4/5 accuracy by hop count at every supervision step"
# to 16 supervision steps, 4x the 4 it trains: what thinking longer does to its answers (the plot marks step 4)
$py -m scripts.base_loss --device_type=cpu --model_tag="$trm" --hops --hops_docs=1000 --n_sup=16
# the plain block at its one step: a second would run the block again on its own answer, which it never trained for
$py -m scripts.base_loss --device_type=cpu --model_tag="$plain" --hops --hops_docs=1000 --n_sup=1

echo "== 5/5 plot"
$py -m dev.plot_hops "$trm" "$plain" --out "$NANOCHAT_BASE_DIR/hops_demo_s$SEED.png"
echo
echo "done in $(( $(date +%s) - start )) s"
