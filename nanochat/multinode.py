"""
A multi-node launch (NNODES>1) shares one NANOCHAT_BASE_DIR: node 0 downloads the shards and trains the tokenizer
into it, then writes a ready marker; every other node waits for that marker before it starts torchrun, so no two
nodes write the same files and none trains before the data is there.
"""

import json
import os
import time

from nanochat.files import atomic_write_bytes, get_base_dir

READY_MARKER = "node0_ready.json"
WAIT_ENV = "NANOCHAT_NODE_WAIT_S"
DEFAULT_WAIT_S = 3 * 3600  # node 0's 100 shard downloads and a tokenizer trained on 1B characters, with room to spare
POLL_S = 5.0


def marker_path():
    return os.path.join(get_base_dir(), READY_MARKER)


def read_marker():
    """What node 0 said it prepared, or None while there is no (complete) marker."""
    try:
        with open(marker_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prepare_on_node0(prepare, prepared, nnodes, node_rank, deadline_s, poll_s=POLL_S):
    """Node 0 (or a single node) runs prepare() and then marks `prepared` (a JSON-able description of what it made)
    as ready; another node waits for that mark. Returns None, or, on a node whose wait passed deadline_s seconds,
    the problem in one line."""
    if nnodes == 1:
        prepare()
        return None
    if node_rank == 0:
        try:  # a marker left by an earlier launch must not release the other nodes before this one is done
            os.remove(marker_path())
        except FileNotFoundError:
            pass
        prepare()
        atomic_write_bytes(marker_path(), json.dumps(prepared, sort_keys=True).encode())
        return None
    return wait_for_node0(prepared, node_rank, deadline_s, poll_s)


def wait_for_node0(prepared, node_rank, deadline_s, poll_s=POLL_S):
    print(f"node {node_rank}: waiting (at most {deadline_s} s) for node 0 to download the data and train the "
          f"tokenizer into {get_base_dir()}", flush=True)
    end = time.monotonic() + deadline_s
    while read_marker() != prepared:
        left = end - time.monotonic()
        if left <= 0:
            found = read_marker()
            return (f"node {node_rank} waited {deadline_s} s for node 0's {marker_path()} saying {prepared} is ready "
                    + (f"but found one for {found}" if found else "and it did not appear")
                    + f": NANOCHAT_BASE_DIR must be a directory shared by every node (the same path on a network "
                      f"filesystem) where node 0 runs the same script; {WAIT_ENV}=<seconds> waits longer")
        time.sleep(min(poll_s, left))
    return None
