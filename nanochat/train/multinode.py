"""
A multi-node launch (NNODES>1) shares one NANOCHAT_BASE_DIR: node 0 downloads the shards and trains the tokenizer
into it, then writes a ready marker; every other node waits for that marker before it starts torchrun, so no two
nodes write the same files and none trains before the data is there.

While node 0 prepares, it beats a heartbeat file in the shared directory. A waiting node that sees no beat within
the probe window (a minute or two) stops at once: the directory is not shared (or node 0 is not running), and
waiting the full deadline would leave its GPUs idle for hours. Beats are a counter, not a clock, so nodes whose
clocks (or the network filesystem's) disagree still see them.
"""

import json
import os
import threading
import time

from nanochat.files import atomic_write_bytes, get_base_dir

READY_MARKER = "node0_ready.json"
HEARTBEAT = "node0_heartbeat.json"
WAIT_ENV = "NANOCHAT_NODE_WAIT_S"
DEFAULT_WAIT_S = 3 * 3600  # node 0's 100 shard downloads and a tokenizer trained on 1B characters, with room to spare
PROBE_ENV = "NANOCHAT_NODE_PROBE_S"
DEFAULT_PROBE_S = 120  # nodes started by hand a minute apart still meet
POLL_S = 5.0
BEAT_S = 5.0
STALE_BEATS = 12  # node 0 is gone when its counter has not moved for this many beats (a minute)


def marker_path(base_dir=None):
    return os.path.join(base_dir or get_base_dir(), READY_MARKER)


def heartbeat_path(base_dir=None):
    return os.path.join(base_dir or get_base_dir(), HEARTBEAT)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_marker(base_dir=None):
    """What node 0 said it prepared, or None while there is no (complete) marker."""
    return read_json(marker_path(base_dir))


class Heartbeat:
    """Node 0's beat while it prepares: a counter rewritten every beat_s seconds by a daemon thread."""

    def __init__(self, base_dir=None, beat_s=BEAT_S):
        self.path, self.beat_s, self.stop = heartbeat_path(base_dir), beat_s, threading.Event()
        self.thread = threading.Thread(target=self.run, name="node0-heartbeat", daemon=True)

    def run(self):
        beat = 0
        while True:
            try:
                atomic_write_bytes(self.path, json.dumps({"beat": beat, "pid": os.getpid()}).encode())
            except OSError:
                pass  # a full or flaky disk: prepare() reports it; the other nodes then time out with the reason
            beat += 1
            if self.stop.wait(self.beat_s):
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def prepare_on_node0(prepare, prepared, nnodes, node_rank, deadline_s, poll_s=POLL_S, probe_s=DEFAULT_PROBE_S,
                     base_dir=None):
    """Node 0 (or a single node) runs prepare() and then marks `prepared` (a JSON-able description of what it made)
    as ready; another node waits for that mark. Returns None, or, on a node whose wait failed (no sign of node 0
    within probe_s, node 0 gone, or deadline_s passed), the problem in one line."""
    if nnodes == 1:
        prepare()
        return None
    if node_rank == 0:
        try:  # a marker left by an earlier launch must not release the other nodes before this one is done
            os.remove(marker_path(base_dir))
        except FileNotFoundError:
            pass
        with Heartbeat(base_dir, beat_s=min(BEAT_S, poll_s)):
            prepare()
        atomic_write_bytes(marker_path(base_dir), json.dumps(prepared, sort_keys=True).encode())
        return None
    return wait_for_node0(prepared, node_rank, deadline_s, poll_s, probe_s, base_dir)


def wait_for_node0(prepared, node_rank, deadline_s, poll_s=POLL_S, probe_s=DEFAULT_PROBE_S, base_dir=None):
    base_dir = base_dir or get_base_dir()
    print(f"node {node_rank}: waiting (at most {deadline_s} s) for node 0 to download the data and train the "
          f"tokenizer into {base_dir}", flush=True)
    start = time.monotonic()
    first_beat = last_beat = read_json(heartbeat_path(base_dir))
    alive, moved_at = False, start
    shared = ("NANOCHAT_BASE_DIR must be a directory shared by every node (the same path on a network filesystem) "
              "where node 0 runs the same script")
    while read_marker(base_dir) != prepared:
        now = time.monotonic()
        beat = read_json(heartbeat_path(base_dir))
        if beat != last_beat:
            alive, last_beat, moved_at = alive or beat != first_beat, beat, now
        if not alive and now - start >= probe_s:
            return (f"node {node_rank} saw no sign of node 0 in {base_dir} within {probe_s:g} s (no ready marker, no "
                    f"heartbeat): {shared}; start node 0 first, or {PROBE_ENV}=<seconds> to wait longer for it")
        if alive and now - moved_at >= STALE_BEATS * min(BEAT_S, poll_s) + poll_s:
            return (f"node {node_rank}: node 0's heartbeat in {heartbeat_path(base_dir)} stopped "
                    f"{now - moved_at:.0f} s ago without a ready marker: node 0 failed (see its output), fix it and "
                    f"launch every node again")
        if now - start >= deadline_s:
            found = read_marker(base_dir)
            return (f"node {node_rank} waited {deadline_s} s for node 0's {marker_path(base_dir)} saying {prepared} is "
                    f"ready " + (f"but found one for {found}" if found else "and it did not appear")
                    + f": {shared}; {WAIT_ENV}=<seconds> waits longer")
        time.sleep(min(poll_s, max(0.0, start + deadline_s - now)))  # a short deadline is not overslept by a poll
    return None
