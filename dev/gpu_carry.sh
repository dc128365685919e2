#!/usr/bin/env bash
# Prepare .gpu_carry/ (git-ignored): what a GPU machine with no network needs beside the repository. By default (~12
# MB) for `dev.gpu_check --quick` and `dev/depth_gpu.sh` (docs/gpus.md): nanochat's GPT package (for the step
# comparison) and the depth experiment's data and tokenizer, built here where rustbpe is installed. With --model-only
# (~100 kB) for `dev.gpu_gap`: nanochat's five model files alone (its GPT needs these modules and no other).
#   bash dev/gpu_carry.sh ~/src/nanochat                 # a checkout of karpathy/nanochat
#   bash dev/gpu_carry.sh --model-only ~/src/nanochat
set -euo pipefail
cd "$(dirname "$0")/.."
model_only=0
if [ "${1:-}" = "--model-only" ]; then model_only=1; shift; fi
nanochat=${1:?usage: bash dev/gpu_carry.sh [--model-only] NANOCHAT_CHECKOUT}
[ -f "$nanochat/nanochat/gpt.py" ] || { echo "gpu_carry: no nanochat/gpt.py in $nanochat" >&2; exit 2; }
grep -qx '/.gpu_carry/' .gitignore || echo '/.gpu_carry/' >> .gitignore
rm -rf .gpu_carry/nanochat
mkdir -p .gpu_carry/nanochat/nanochat
for f in __init__ common gpt optim flash_attention; do  # its GPT and optimizer need these modules only
    [ -f "$nanochat/nanochat/$f.py" ] && cp "$nanochat/nanochat/$f.py" .gpu_carry/nanochat/nanochat/
done
git -C "$nanochat" rev-parse HEAD > .gpu_carry/nanochat/COMMIT 2>/dev/null || true
if [ "$model_only" = 1 ]; then du -sh .gpu_carry/nanochat; exit 0; fi
bash dev/setup_env.sh plot
export NANOCHAT_BASE_DIR=$PWD/.gpu_carry/depth_base
[ -d "$NANOCHAT_BASE_DIR/base_data" ] || .venv/bin/python -m nanochat.dataset --builtin
[ -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ] || \
    .venv/bin/python -m scripts.tok_train --vocab_size=8192 --max_chars=200000000
du -sh .gpu_carry
