#!/usr/bin/env bash
# Issue 51 item 6: text at GPU scale, prepared for one H100 with no network (torch 2.11, no rustbpe: the byte-level
# tokenizer needs no training). Five models on the offline corpus (this Python's standard library) at equal tokens,
# width 384 (3 heads of 128), 2048-token rows, bf16, compiled, through scripts/compare.py --mode=tokens:
#   plain2       the plain model of the recursion's parameters (2 blocks)
#   plain24      a deeper plain model of about the recursion's training FLOPs (2 blocks x 3 applications x 4 steps)
#   loopnc       a looped_nanochat-style recipe: a plain prelude block, 2 blocks looped (mean 3 loops, Huginn's
#                log-normal Poisson draw), a plain coda block; gradients through 2 loops at a time; a loop-count
#                warmup over the first 60%; the loss on the last loop (weights base 100: earlier loops ~1%)
#   default      the detached recipe, gpt.py's default until issue 57, every field spelled out
#   holding      issue 51's best candidate, issue 57's new default: log-normal drawn step counts, gradients through
#                4 steps, a step-count curriculum over the first half
# Part c (issue 57 item 8, the equal-FLOPs question, one call of at most 5 minutes at TOKENS=4e7): the new default
# (holding) against plain24 and loopnc, evaluation trimmed (4 evaluations of 262,144 tokens), the three at once on
# the one GPU, each into $OUT/<model>/ with its log $OUT/<model>.log; ~275 s planned from the H200's measured speeds
# and compile times (python -m dev.loop_gpu plan c: the sums and their sources):
#   TOKENS=4e7 bash dev/loop_gpu.sh c
# Part d (issue 57 item 4: do later steps stop hurting on text?), one call of at most 7 minutes at TOKENS=4e7: the
# new default (holding) beside the same with the consistency term (consist: --consistency_weight=1.0, which held on
# CPU text but slowed the CPU demo's climb; consist03: 0.3), all at once; compare.md's bpb at N, 2N, 4N answers it
# (python -m dev.loop_gpu plan d --tokens 4e7 prints the planned time):
#   TOKENS=4e7 bash dev/loop_gpu.sh d
# Run a and b in two parts, each one 9-minute call (estimated at 40% MFU by train/flops.estimate_flops, printed
# first; plan without training: python -m dev.loop_gpu plan a):
#   bash dev/loop_gpu.sh a            # plain2, plain24, loopnc
#   bash dev/loop_gpu.sh b            # default, holding
#   TOKENS=2e7 bash dev/loop_gpu.sh a -- --eval_tokens=262144     # flags after -- go to base_train
# Each part rewrites $OUT/compare.md (bpb by supervision step at inference) and $OUT/table.md: every model's
# tokens/s and validation bpb by training step, with every model any part finished (a rerun skips them).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-a}
shift || true
[ "${1:-}" = "--" ] && shift
case "$part" in
    a|b|c|d|all) ;;
    *) echo "loop_gpu: unknown part '$part'; choose a, b, c, d or all" >&2; exit 2 ;;
esac
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$PWD/loop_gpu/base}"
OUT="${OUT:-loop_gpu}"
TOKENS="${TOKENS:-1e8}"
if ! [[ "$TOKENS" =~ ^[0-9]+([.][0-9]+)?([eE][0-9]+)?$ ]]; then
    echo "loop_gpu: TOKENS=$TOKENS must be a number (e.g. TOKENS=1e8)" >&2; exit 2
fi
py=${PYTHON:-}
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }  # the GPU machine's own python3

[ -d "$NANOCHAT_BASE_DIR/base_data" ] || $py -m nanochat.dataset --builtin
[ -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.json" ] || $py -m scripts.tok_train --byte_level
$py -m dev.loop_gpu run "$part" --tokens "$TOKENS" --out "$OUT" -- "$@"
echo "tables: $OUT/compare.md (bpb by supervision step), $OUT/table.md (tokens/s, bpb by training step)"
