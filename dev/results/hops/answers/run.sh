# usage: g36.sh SEED RUNS [extra args]
cd /work/wt36
S=$1; R=$2; shift 2
OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/main/.venv/bin/python -m dev.hops_grid --task answers --runs $R --seed $S --out dev/results/hops/answers/seed$S.jsonl --save_dir /tmp/hops36_models "$@"
