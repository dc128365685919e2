#!/usr/bin/env bash
# Issue 32's language-model question, on one GPU: does depth pay on text at this scale, and does the recursion buy it?
# Plain GPTs of 4, 8 and 16 layers, the 4 blocks simply looped 4 times and gpt.py's default recursion
# (scripts/compare.py --grid=depth), all of width 512, at equal tokens (TOKENS) on the offline corpus (this Python's
# standard library). Needs no network: the data is built here, the tokenizer too where rustbpe is installed, or both
# are carried in $NANOCHAT_BASE_DIR (docs/gpus.md). Run it whole, or in parts that each fit one 9-minute call:
#   bash dev/depth_gpu.sh                 # every part in turn
#   bash dev/depth_gpu.sh plain           # plain4, plain8, plain16
#   bash dev/depth_gpu.sh loop            # loop4x4
#   bash dev/depth_gpu.sh default         # default4
#   bash dev/depth_gpu.sh core            # plain4, loop4x4, default4: the question at its smallest
#   TOKENS=2e7 bash dev/depth_gpu.sh plain -- --eval_tokens=262144   # flags after -- go to base_train
# The table ($OUT/compare.md) is rewritten after each model, with every model any part finished: a part stopped by
# its time limit keeps what finished, and running a part again skips its finished models.
# Estimated at 40% MFU on one H100 for TOKENS=5e7 (train/flops.estimate_flops): plain 2.0 min, loop 1.3, default 3.4, plus
# about a minute per model of compile and evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
[ "${1:-}" = "--" ] && shift
case "$part" in
    all) only=plain4,plain8,plain16,loop4x4,default4 ;;
    plain) only=plain4,plain8,plain16 ;;
    loop) only=loop4x4 ;;
    default) only=default4 ;;
    core) only=plain4,loop4x4,default4 ;;
    *) echo "depth_gpu: unknown part '$part'; choose all, plain, loop, default or core" >&2; exit 2 ;;
esac
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$PWD/depth_gpu/base}"
OUT="${OUT:-depth_gpu}"
TOKENS="${TOKENS:-5e7}"
BATCH_TOKENS="${BATCH_TOKENS:-131072}"  # 64 sequences of 2048 per step
if ! [[ "$TOKENS" =~ ^[0-9]+([.][0-9]+)?([eE][0-9]+)?$ && "$BATCH_TOKENS" =~ ^[0-9]+$ ]]; then
    echo "depth_gpu: TOKENS=$TOKENS and BATCH_TOKENS=$BATCH_TOKENS must be numbers (e.g. TOKENS=5e7)" >&2; exit 2
fi
py=${PYTHON:-}
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }  # the GPU machine's own python3

[ -d "$NANOCHAT_BASE_DIR/base_data" ] || $py -m nanochat.dataset --builtin
if [ ! -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ]; then
    $py -c "import rustbpe" 2>/dev/null || { echo "depth_gpu: no tokenizer in $NANOCHAT_BASE_DIR/tokenizer and no" \
        "rustbpe to train one: carry one (docs/gpus.md) or pip install rustbpe" >&2; exit 2; }
    $py -m scripts.tok_train --vocab_size=8192 --max_chars=200000000
fi
# the numbers travel as arguments, never inside the program's text
steps=$($py -c 'import sys; print(max(1, round(float(sys.argv[1]) / int(sys.argv[2]))))' "$TOKENS" "$BATCH_TOKENS")
$py -m scripts.compare --grid=depth --mode=tokens --num_iterations="$steps" --only="$only" --out="$OUT" -- \
    --n_embd=512 --n_head=4 --max_seq_len=2048 --device_batch_size=16 --total_batch_size="$BATCH_TOKENS" \
    --compile=true --dtype=bfloat16 --eval_tokens=1048576 --sample_every=0 "$@"
echo "table: $OUT/compare.md"
