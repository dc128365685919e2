"""
The CPU threads a shell pipeline gives every stage: OMP_NUM_THREADS if set, else the cores this process may use that
other work leaves free now (nanochat/common.py: cpu_threads). Prints the count on stdout, the reason on stderr:

    export OMP_NUM_THREADS="$(.venv/bin/python -m dev.threads)"      # what dev/runcpu.sh and runcpu_chat.sh do
"""

import sys

from nanochat.common import cpu_threads


def main(argv=None):
    if argv if argv is not None else sys.argv[1:]:
        sys.exit("usage: python -m dev.threads   (no arguments; OMP_NUM_THREADS=N wins over the measurement)")
    threads, why = cpu_threads()
    print(f"CPU threads: {threads} ({why}; OMP_NUM_THREADS=N sets it)", file=sys.stderr, flush=True)
    print(threads)


if __name__ == "__main__":
    main()
