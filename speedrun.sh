#!/usr/bin/env bash
# The whole nanochat-TRM pipeline on one 8-GPU node (8x B200, H200, H100 or A100 80GB), top to bottom:
#   environment -> data -> tokenizer (+ its evaluation) -> Phase 1 (fast) -> its verification -> Phase 2 (extreme)
#   -> evaluation of the final model -> samples -> chat fine-tuning (SFT) -> chat evaluation -> the run report.
#
#   bash speedrun.sh                 # the GPUs are detected; HARDWARE=8xA100 picks a row of the table yourself
#   DRY_RUN=1 bash speedrun.sh       # print every step and both plans, run nothing
#   FORCE=1 bash speedrun.sh         # go on to Phase 2 even if Phase 1 misses a success criterion
#   SFT_DATA=chats.jsonl bash speedrun.sh   # the SFT conversations (default hf:HuggingFaceTB/smol-smoltalk)
# The environment overrides of scripts/train_*.sh (DEPTH, NANOCHAT_BASE_DIR, ...) apply here too.
set -euo pipefail
cd "$(dirname "$0")"
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
dry_run() { [ "${DRY_RUN:-0}" != 0 ]; }
say() { printf '\n=== %s ===\n' "$*"; }
run() { echo "+ $*"; if ! dry_run; then "$@"; fi; }

say "1. Environment: .venv with the project installed"
if dry_run && [ ! -x .venv/bin/python ]; then
    echo "DRY_RUN needs the environment to print the plans: run 'bash dev/setup_env.sh' first" >&2
    exit 1
fi
run bash dev/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"

say "2. Hardware: which 8-GPU node is this?"
hw=$(python -m scripts.launch detect --gpus=8)
echo "this node: $hw (scripts/train_${hw}_fast.sh and scripts/train_${hw}_extreme.sh)"

say "3. Data: 100 FineWeb-Edu shards, enough for both phases (complete shards are kept)"
run python -m nanochat.dataset -n 100

say "4. Tokenizer: trained on 1B characters (unless one exists), then its compression"
if [ -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ]; then
    echo "tokenizer present in $NANOCHAT_BASE_DIR/tokenizer"
else
    run python -m scripts.tok_train --max_chars="${TOK_MAX_CHARS:-1000000000}" --vocab_size="${VOCAB_SIZE:-65536}"
fi
run python -m scripts.tok_eval

say "5. Phase 1 (fast): does the refinement work? (prints its plan, then trains)"
bash "scripts/train_${hw}_fast.sh"

say "6. Phase 1 gate: do the later supervision steps beat the first? (the guides' 15-25% refinement is reported, not enforced)"
if ! run python -m scripts.launch check --model_tag="${hw}_fast" --phase=fast; then
    if [ "${FORCE:-0}" = 0 ]; then
        echo "Phase 1 predicts a wasted Phase 2 (see the NOT MET line): stopping (FORCE=1 goes on anyway)" >&2
        exit 1
    fi
    echo "FORCE=1: going on to Phase 2 anyway"
fi

say "7. Phase 2 (extreme): the final model (passes --preset=extreme itself; no edit of gpt.py needed)"
bash "scripts/train_${hw}_extreme.sh"

say "8. Evaluation of the final model: train/val bits per byte of every supervision step"
run torchrun --standalone --nproc_per_node=8 -m scripts.base_loss -- --model_tag="${hw}_extreme"

say "9. Samples from the final model"
run python -m scripts.base_sample --model_tag="${hw}_extreme"

say "10. Chat: the final model fine-tuned on conversations, every supervision step trained (docs/chat.md)"
run torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft -- --model_tag="${hw}_extreme" \
    --data="${SFT_DATA:-hf:HuggingFaceTB/smol-smoltalk}"

say "11. Chat evaluation: exact match by supervision step on the built tasks"
run python -m scripts.chat_eval --model_tag="${hw}_extreme_sft"

say "12. Run report"
run python -m scripts.launch report "${hw}_fast:fast" "${hw}_extreme:extreme" --out="$NANOCHAT_BASE_DIR/speedrun_report.md"
