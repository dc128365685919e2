#!/usr/bin/env bash
# Issue 32's language-model question, on one GPU: does depth pay on text at this scale, and does the recursion buy it?
# Plain GPTs of 4, 8 and 16 layers, the 4 blocks simply looped 4 times and gpt.py's default recursion
# (scripts/compare.py --grid=depth), all of width 512, at equal tokens (TOKENS, default ~1e8) on the offline corpus
# (this Python's standard library: no network needed, built on the GPU machine itself).
#   bash dev/depth_gpu.sh                       # one GPU; writes depth_gpu/compare.md, compare.json, plots
#   TOKENS=2e7 bash dev/depth_gpu.sh            # a shorter run
# Estimated from GPT.estimate_flops at 40% MFU on one H100: ~13 min of training for the 5 models (plain4/8/16 0.6, 1.2
# and 2.2 min, the 4x loop 2.5, the default recursion 6.8), plus compile and evaluation; it has not run on a GPU yet.
# At a lower MFU, TOKENS=5e7 halves it. Extra arguments go to base_train.
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$PWD/depth_gpu/base}"
OUT="${OUT:-depth_gpu}"
TOKENS="${TOKENS:-1e8}"
BATCH_TOKENS=131072  # 64 sequences of 2048 per step
bash dev/setup_env.sh plot
py=.venv/bin/python

$py -m nanochat.dataset --builtin
if [ ! -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ]; then
    $py -m scripts.tok_train --vocab_size=8192 --max_chars=200000000
fi
steps=$($py -c "print(max(1, round(float('$TOKENS') / $BATCH_TOKENS)))")
$py -m scripts.compare --grid=depth --mode=tokens --num_iterations="$steps" --out="$OUT" -- \
    --n_embd=512 --n_head=4 --max_seq_len=2048 --device_batch_size=16 --total_batch_size="$BATCH_TOKENS" \
    --compile=true --dtype=bfloat16 --eval_tokens=2097152 --sample_every=0 "$@"
echo "table: $OUT/compare.md"
