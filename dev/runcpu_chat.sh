#!/usr/bin/env bash
# The chat stage on a CPU, offline, after dev/runcpu.sh: its model (cpu_d4) fine-tuned on the built conversation set
# (arithmetic in words, hops lookups: nanochat/data/chat_tasks.py), then exact match by supervision step on the
# set's test split, before and after. At most 10 minutes on 2 cores (see docs/chat.md for the measured run).
# Everything lands in $NANOCHAT_BASE_DIR (default ~/.cache/nanochat-cpu, as dev/runcpu.sh).
# Extra arguments go to chat_sft and win over the values below, e.g. bash dev/runcpu_chat.sh --num_epochs=2
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat-cpu}"
MODEL_TAG="${MODEL_TAG:-cpu_d4}"
SFT_TAG="${SFT_TAG:-${MODEL_TAG}_sft}"
EVAL_LIMIT="${EVAL_LIMIT:-100}"  # test questions per task
start=$(date +%s)

bash dev/setup_env.sh plot,serve  # serve: scripts.serve and its clients (httpx, openai), to talk to the result
py=.venv/bin/python
# every stage's CPU threads: OMP_NUM_THREADS if set, else the cores other work leaves free now (it says which)
OMP_NUM_THREADS="$($py -m dev.threads)"
export OMP_NUM_THREADS
if ! compgen -G "$NANOCHAT_BASE_DIR/base_checkpoints/$MODEL_TAG/step_*" > /dev/null; then
    echo "no base model $MODEL_TAG under $NANOCHAT_BASE_DIR: run bash dev/runcpu.sh first" >&2
    exit 1
fi

echo "== 1/3 the base model on 20 questions a task (it has never seen the chat tokens, so it does not answer)"
$py -m scripts.chat_eval --device_type=cpu --model_tag="$MODEL_TAG" --n_sup=3 --limit=20 --max_tokens=8

echo "== 2/3 fine-tune it on the built conversations (every supervision step trained)"
# base_train's default learning rates, 4x the base run's (dev/runcpu.sh's): one epoch of 53 steps is short, and at
# the base's rates arithmetic stayed at 0.09 where these reach 0.18-0.21 (docs/chat.md)
resume=""  # run again, the stage continues (or re-checks) its run instead of refusing the used tag
if compgen -G "$NANOCHAT_BASE_DIR/base_checkpoints/$SFT_TAG/step_*" > /dev/null; then resume="--resume"; fi
$py -m scripts.chat_sft --device_type=cpu --model_tag="$MODEL_TAG" --data=builtin --sft_tag="$SFT_TAG" \
    --num_epochs=1 --matrix_lr=0.02 --embedding_lr=0.2 --unembedding_lr=0.004 --eval_every=40 --eval_tokens=16384 --sample_every=40 --sample_tokens=8 --save_every=40 \
    --keep_last=2 ${resume:+"$resume"} "$@"

echo "== 3/3 exact match by supervision step (the 3 trained, and 3 more), and the plots"
$py -m scripts.chat_eval --device_type=cpu --model_tag="$SFT_TAG" --n_sup=6 --limit="$EVAL_LIMIT" --max_tokens=8
$py -m scripts.plot_run "$SFT_TAG"

# the closing summary: what was made, and the commands that serve the chat model and ask it
run_dir="$NANOCHAT_BASE_DIR/base_checkpoints/$SFT_TAG"
echo
echo "done in $(( ($(date +%s) - start) / 60 )) min"
echo "accuracy by step: $run_dir/chat_eval_step*.md and .png (the base model's: base_checkpoints/$MODEL_TAG/)"
echo "training plot:    $run_dir/training.png"
echo
echo "next: serve the chat model $SFT_TAG from $NANOCHAT_BASE_DIR (not the default ~/.cache/nanochat), then ask it"
printf '  export NANOCHAT_BASE_DIR=%q\n' "$NANOCHAT_BASE_DIR"
echo "  $py -m scripts.serve --device_type=cpu --model_tag=$SFT_TAG   # the viewer, with a Chat tab: http://127.0.0.1:8000/"
echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is two plus three?\"}], \"temperature\": 0}'"
echo "  (from Python: the openai client, as in docs/chat.md)"
