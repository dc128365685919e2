#!/usr/bin/env bash
# Issue 36 item 3 on one GPU in one call of ~8 minutes: the product's hops corpus in the pairs-and-answers format
# (--synthetic=hops_pairs, 8 symbols so no plain block can hold the table, 1-4 hops) trained through base_train:
# the default recursion of one block, the plain block (equal parameters) and two plain blocks (the positive control),
# on seeds 42 and 43, side by side; beside them the in-memory runner (dev/hops.py --format pairs) on the same corpus
# and budget, which tells base_train's path from the recursion. Then base_loss --hops on every tag.
#   bash dev/hops_base_gpu.sh OUT            # OUT gets summary.txt and results.tgz (logs, hops_eval json, checkpoints)
# The corpus and tokenizer are built where they are missing ($NANOCHAT_BASE_DIR, default .gpu_carry/hops_base: build
# it here and carry it to save ~30 s). Every run stops itself at --max_hours=$HOURS and saves, so a slow GPU still
# leaves checkpoints to score.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${1:?usage: bash dev/hops_base_gpu.sh OUT}
STEPS=${STEPS:-1500}
HOURS=${HOURS:-0.1}
SEEDS=${SEEDS:-42 43}
DEVICE=${DEVICE:-cuda}
py=${PYTHON:-python3}
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$PWD/.gpu_carry/hops_base}"
mkdir -p "$OUT/logs"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

[ -d "$NANOCHAT_BASE_DIR/base_data" ] || \
    $py -m nanochat.dataset --synthetic=hops_pairs --hops_symbols=8 --hops_max=4 --synthetic_docs=400000
[ -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ] || $py -m scripts.tok_train --byte_level

# one document per row, as dev/hops.py trains: the loader cuts the <|bos|>-first document stream into rows of
# max_seq_len+1 tokens, and a document is <|bos|> + 106 characters, so --max_seq_len=106 makes every row one whole
# document. With 128, rows held the end of one document (its table in the row before) and the start of the next,
# and seeds 42 and 44 never left the plateau on the H200 (issue 36: dev/LOG.md). 256 rows a step, all at once.
train() {
    local tag=$1; shift
    $py -m scripts.base_train --device_type="$DEVICE" --depth=1 --n_embd=64 --n_head=2 --max_seq_len=106 --rows=documents \
        --device_batch_size=256 --total_batch_size=27136 --num_iterations="$STEPS" --warmup_steps=100 \
        --warmdown_ratio=0.3 --matrix_lr=0.02 --embedding_lr=0.2 --unembedding_lr=0.004 --ema_decay=0 \
        --eval_every=500 --eval_tokens=32768 --sample_every=0 --save_every=500 --keep_last=1 --max_hours="$HOURS" \
        --model_tag="$tag" "$@" > "$OUT/logs/$tag.log" 2>&1 || echo "base_train $tag: exit $?" >> "$OUT/logs/$tag.log"
}
memory() {
    local seed=$1
    timeout "$(awk -v h="$HOURS" 'BEGIN { print int(h * 3600) + 30 }')" "$py" -m dev.hops --name memory_default --format pairs --n_symbols 8 --max_hops 4 \
        --n_queries 24 --depth 1 --width 64 --batch 256 --steps "$STEPS" --warmup 100 --warmdown 0.3 --eval_every 500 \
        --eval_docs 1000 --seed "$seed" --device "$DEVICE" --out "$OUT/memory.jsonl" > "$OUT/logs/memory_$seed.log" 2>&1
}
# RUNS names the base_train configurations (flags in flags_of), MEMORY=0 leaves out the in-memory runner
flags_of() {
    case "$1" in
        trm) echo "" ;;
        trm_fp32) echo "--dtype=float32" ;;             # base_train's autocast off, as dev/hops.py runs
        plain1) echo "--n_loops=0 --n_sup_train=1" ;;
        plain2) echo "--depth=2 --n_loops=0 --n_sup_train=1" ;;
        *) echo "hops_base_gpu: unknown run '$1'" >&2; return 1 ;;
    esac
}
tags=()
for seed in $SEEDS; do
    for run in ${RUNS:-trm plain1 plain2}; do
        flags=$(flags_of "$run") || exit 2
        read -ra flags <<< "$flags"
        train "${run}_$seed" --seed="$seed" "${flags[@]}" &
        tags+=("${run}_$seed")
    done
    [ "${MEMORY:-1}" = 1 ] && memory "$seed" &
done
wait
echo "trained in $(( $(date +%s) - start )) s"

for tag in "${tags[@]}"; do
    n_sup=""; [[ $tag == plain* ]] && n_sup="--n_sup=1"  # a plain model has one step; a second reruns it on its answer
    $py -m scripts.base_loss --device_type="$DEVICE" --model_tag="$tag" --hops --hops_docs=1000 $n_sup \
        > "$OUT/logs/$tag.hops.log" 2>&1 &
done
wait
{
    echo "== $(( $(date +%s) - start )) s in all"
    for tag in "${tags[@]}"; do
        echo "== $tag"; grep -E "^step |stopp|Error|error" "$OUT/logs/$tag.log" | tail -n 4; cat "$OUT/logs/$tag.hops.log"
    done
    for seed in $SEEDS; do [ -e "$OUT/logs/memory_$seed.log" ] && { echo "== memory $seed"; tail -n 12 "$OUT/logs/memory_$seed.log"; }; done
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
touch "$OUT/memory.jsonl"
tar -czf "$OUT/results.tgz" -C "$OUT" logs memory.jsonl -C "$NANOCHAT_BASE_DIR" base_checkpoints 2>/dev/null
rm -rf "$OUT/logs"
