#!/usr/bin/env bash
# Does the recursion use its depth? On a CPU with no network, through the product's scripts: the hops corpus
# (7-symbol cycles, 1-3 hops, earlier answers in the text, one lookup learned first) -> a byte-level tokenizer ->
# base_train of gpt.py's default recursion and of the plain model of the same block, side by side on one core each ->
# base_loss --hops -> one plot of the 3-hop accuracy at every supervision step, to 4x the 4 it trains.
# The corpus and training flags, and the same demo over many seeds: dev/hops_demo.py. What to expect (the seeds that
# climb, the times): docs/reasoning.md; the numbers: dev/LOG.md (issue 57).
# Everything lands in $NANOCHAT_BASE_DIR (default ~/.cache/nanochat-hops); SEED=N draws other initial weights (the
# tags and the plot carry it), STEPS=N trains longer or shorter; running it again continues a run that was stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat-hops}"
SEED="${SEED:-42}"
start=$(date +%s)

echo "== 1/2 environment"
bash dev/setup_env.sh plot

echo "== 2/2 corpus, tokenizer, the recursion and the plain block (${STEPS:-1000} steps each), scores and the plot"
.venv/bin/python -m dev.hops_demo --seeds "$SEED" --plain --plot --continue -- ${STEPS:+"--num_iterations=$STEPS"}
echo
echo "done in $(( $(date +%s) - start )) s; the plot: $NANOCHAT_BASE_DIR/hops_demo_s$SEED.png"
