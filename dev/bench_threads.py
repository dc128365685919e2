"""
dev/runcpu.sh's training step at 1 and 2 CPU threads, alone and beside busy processes (`python -c 'while True:
pass'`), and what the automatic choice (nanochat/common.py: cpu_threads) picks in each case. Needs the pipeline's
corpus and tokenizer in $NANOCHAT_BASE_DIR (bash dev/runcpu.sh makes them; or nanochat.dataset --builtin and
scripts.tok_train --vocab_size=4096 --max_chars=20000000); writes only under a temporary tag, removed after.

    NANOCHAT_BASE_DIR=~/.cache/nanochat-cpu python -m dev.bench_threads --steps 6 --busy 0,1
    NANOCHAT_BASE_DIR=~/.cache/nanochat-cpu python -m dev.bench_threads --steps 6 --busy 0 --cpu   # + CPU s/step
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from nanochat.files import get_base_dir

# dev/runcpu.sh's base_train flags, the horizon and evaluation aside
RUNCPU = ["--device_type=cpu", "--depth=4", "--max_seq_len=256", "--device_batch_size=8", "--total_batch_size=2048",
          "--n_loops=1", "--n_sup_train=3", "--T_recursion=1", "--preset=aggressive", "--warmup_steps=10",
          "--matrix_lr=0.005", "--embedding_lr=0.05", "--unembedding_lr=0.001", "--warmdown_ratio=0.6",
          "--eval_every=0", "--eval_tokens=256", "--sample_every=0", "--save_every_minutes=0", "--keep_last=1"]
BUSY = [sys.executable, "-c", "while True: pass"]


def cpu_seconds():
    """CPU time (user + system) of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def step_times(threads, steps, tag):
    """(seconds per step of a fresh run's steps 2..steps (the first warms up) at `threads` threads, the run's CPU
    seconds); its directory is removed after."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run_dir = os.path.join(get_base_dir(), "base_checkpoints", tag)
    cpu = cpu_seconds()
    try:
        subprocess.run([sys.executable, "-m", "scripts.base_train", *RUNCPU, f"--num_iterations={steps}",
                        f"--model_tag={tag}"], env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return [r["dt"] for r in records if r["kind"] == "train" and r["step"] > 1], cpu_seconds() - cpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="training steps a run (the first is left out)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--busy", default="0,1", help="comma-separated counts of busy processes beside the run")
    p.add_argument("--cpu", action="store_true",
                   help="also the CPU seconds a step costs (a 1-step run's subtracted): what a step takes on a quiet "
                        "machine at 1 thread, where the wall clock of a shared one cannot say")
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs, affinity {sorted(os.sched_getaffinity(0))}; dev/runcpu.sh's model, "
          f"{args.steps - 1} timed steps a run")
    for busy in map(int, args.busy.split(",")):
        hogs = [subprocess.Popen(BUSY) for _ in range(busy)]
        try:
            time.sleep(2)  # let the busy processes show in /proc/stat
            unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a user without it
            choice = subprocess.run([sys.executable, "-m", "dev.threads"], env=unset, capture_output=True,
                                    text=True, check=True, timeout=120).stderr.strip()
            print(f"busy processes {busy}: the automatic choice: {choice}", flush=True)
            for threads in map(int, args.threads.split(",")):
                load = os.getloadavg()[0]
                times, cpu = step_times(threads, args.steps, f"bench_threads_{os.getpid()}_{busy}_{threads}")
                if args.cpu:
                    cpu = (cpu - step_times(threads, 1, f"bench_threads_{os.getpid()}_{busy}_{threads}_1")[1]) / \
                        (args.steps - 1)
                print(f"  {threads} thread(s): {statistics.median(times):.2f} s/step median (min "
                      f"{min(times):.2f}, max {max(times):.2f})" + (f" | {cpu:.2f} CPU s/step" if args.cpu else "") +
                      f" | load average before {load:.2f}", flush=True)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()

if __name__ == "__main__":
    main()
