#!/usr/bin/env bash
# The whole pipeline on a CPU with no network: ~7 minutes on 2 quiet cores, ~25 on busy ones (dev/LOG.md, issue 58):
# environment -> built-in corpus -> tokenizer -> a small TRM model -> evaluation -> samples -> plot.
# Everything lands in $NANOCHAT_BASE_DIR (default ~/.cache/nanochat-cpu, apart from GPU runs' data).
# Extra arguments go to base_train and win over the values below, e.g. bash dev/runcpu.sh --num_iterations=40
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat-cpu}"
MODEL_TAG="${MODEL_TAG:-cpu_d4}"
start=$(date +%s)

echo "== 1/6 environment"
bash dev/setup_env.sh plot,serve  # serve: scripts.serve and its clients, for the commands printed at the end
py=.venv/bin/python
# every stage's CPU threads: OMP_NUM_THREADS if set, else the cores other work leaves free now (it says which)
OMP_NUM_THREADS="$($py -m dev.threads)"
export OMP_NUM_THREADS

echo "== 2/6 built-in corpus (Python's standard library, offline)"
$py -m nanochat.dataset --builtin

echo "== 3/6 tokenizer"
if [ ! -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ]; then
    $py -m scripts.tok_train --vocab_size=4096 --max_chars=20000000
fi
$py -m scripts.tok_eval --references=none  # offline: no GPT-2/GPT-4 download tried

echo "== 4/6 train a depth-4 TRM model (1 latent loop, 3 supervision steps)"
# A plain depth-4 GPT costs 1/5 of this model per token: the recursion is not free, and the log's tok/s shows it.
# The recursion is gpt.py's default (TRM state update, drawn step counts with gradients through 4 steps, and
# base_train's step-count curriculum over the first half); at 120 steps base_train's weight average is off (auto
# starts at 300). Learning rates are 1/4 of the defaults (tuned for 0.5M-token batches) and the warmdown is long.
resume=""  # run again, the pipeline continues (or re-checks) its run instead of refusing the used tag
if compgen -G "$NANOCHAT_BASE_DIR/base_checkpoints/$MODEL_TAG/step_*" > /dev/null; then resume="--resume"; fi
$py -m scripts.base_train --device_type=cpu --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=2048 \
    --n_loops=1 --n_sup_train=3 --T_recursion=1 --preset=aggressive --num_iterations=120 --warmup_steps=10 \
    --matrix_lr=0.005 --embedding_lr=0.05 --unembedding_lr=0.001 --warmdown_ratio=0.6 \
    --eval_every=40 --eval_tokens=16384 --sample_every=60 --save_every=40 --keep_last=2 \
    --model_tag="$MODEL_TAG" ${resume:+"$resume"} "$@"

echo "== 5/6 evaluate (6 supervision steps: the 3 trained, and 3 more to show they do not hurt) and sample"
$py -m scripts.base_loss --device_type=cpu --model_tag="$MODEL_TAG" --device_batch_size=8 --max_seq_len=256 \
    --split_tokens=32768 --n_sup=6
$py -m scripts.base_sample --device_type=cpu --model_tag="$MODEL_TAG" --prompt="def main():" --max_tokens=24 \
    --show_steps

echo "== 6/6 plot"
$py -m scripts.plot_run "$MODEL_TAG"

# the closing summary: what was made, and the next commands, with the base directory and tag that find the model
run_dir="$NANOCHAT_BASE_DIR/base_checkpoints/$MODEL_TAG"
echo
echo "done in $(( ($(date +%s) - start) / 60 )) min"
echo "checkpoints: $run_dir/step_*"
echo "report:      $run_dir/report.md"
echo "plot:        $run_dir/training.png"
echo "metrics:     $run_dir/metrics.jsonl"
echo
echo "next: the model is $MODEL_TAG in $NANOCHAT_BASE_DIR (not the default ~/.cache/nanochat): set it first"
printf '  export NANOCHAT_BASE_DIR=%q\n' "$NANOCHAT_BASE_DIR"
echo "  $py -m scripts.base_sample --device_type=cpu --model_tag=$MODEL_TAG --prompt='def fibonacci(n):' --show_steps"
echo "  $py -m scripts.base_loss --device_type=cpu --model_tag=$MODEL_TAG --split_tokens=32768 --n_sup=8"
echo "  $py -m scripts.serve --device_type=cpu --model_tag=$MODEL_TAG   # then open http://127.0.0.1:8000/"
echo "  bash dev/runcpu_chat.sh   # the chat stage: $MODEL_TAG fine-tuned on conversations, then served"
