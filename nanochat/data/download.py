"""Downloading files of a Hugging Face hub repository over plain HTTP, for `python -m nanochat.dataset -n N`.

Each file is fetched into a locked partial file beside its final name, resumed where a cut connection stopped (HTTP
Range), retried with jittered backoff on transient failures, checked, and only then renamed into place. Each file has
an overall deadline (--shard_timeout); Ctrl-C stops every thread at once and leaves no partial file. The endpoint can
be a mirror (NANOCHAT_HF_ENDPOINT, then HF_ENDPOINT).

Why not huggingface_hub's hf_hub_download (installed with `datasets`): tried (2.4.0) against tests/test_download.py's
local server, it needs a HEAD answer with hub metadata, fails a shard at once on an HTTP 500, has no overall deadline
(a server sending one byte every 0.1 s held it past 20 s), and leaves .cache/huggingface/ metadata, locks and
.incomplete files in the shard directory. Every one of those is a behaviour the tests pin down, so this module keeps
its own ~200 lines of urllib.
"""

import contextlib
import fcntl
import glob
import os
import queue
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException

from nanochat.common import progress_bar

TIMEOUT_S = 30  # per connect and per read: a stalled connection fails instead of hanging every rank
SHARD_TIMEOUT_S = 600  # per shard, retries included: a server trickling bytes cannot hang a download forever
TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
PARTIAL = ".tmp"  # a partial file is its final name + .tmp + the pid of the process writing it


class DownloadError(Exception):
    """A download that failed for good, or a bad endpoint: the message names the file and URL, or the variable."""


class TransientError(Exception):
    def __init__(self, reason, retry_after=None):
        super().__init__(reason)
        self.retry_after = retry_after


class Stopped(Exception):
    """Ctrl-C: the main thread asked every download to stop."""


def hub_endpoint():
    for var in ("NANOCHAT_HF_ENDPOINT", "HF_ENDPOINT"):
        endpoint = os.environ.get(var)
        if endpoint:
            url = urllib.parse.urlsplit(endpoint)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise DownloadError(f"{var}={endpoint!r} is not an http(s) URL; set it to a hub or mirror such as "
                                    "https://huggingface.co, or unset it")
            return endpoint.rstrip("/")
    return "https://huggingface.co"


def hub_dataset_url(repo_id, name):
    from huggingface_hub import hf_hub_url  # lazy: ~0.3 s to import, for hub datasets only; it knows the URL layout
    return hf_hub_url(repo_id, name, repo_type="dataset", endpoint=hub_endpoint())


def continues_at(response, offset):
    """Whether a response to `Range: bytes=offset-` holds exactly the rest of the file."""
    return response.status == 206 and response.headers.get("Content-Range", "").startswith(f"bytes {offset}-")


def fetch_into(f, url, deadline, stop, on_bytes, problem):
    """One attempt: complete the open file f with url's body, asking only for the bytes f lacks (HTTP Range).

    Raises TransientError for what a retry may fix, DownloadError for what it won't, Stopped on Ctrl-C."""
    offset = f.seek(0, os.SEEK_END)
    headers = {"User-Agent": "nanochat", **({"Range": f"bytes={offset}-"} if offset else {})}
    timeout = max(0.1, min(TIMEOUT_S, deadline - time.monotonic()))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
            if offset and not continues_at(response, offset):  # the server sent the whole file: start over
                f.seek(0)
                f.truncate()
            expected = response.headers.get("Content-Length")
            received = 0
            # read1 returns what has arrived, so Ctrl-C and the deadline are checked even on a trickling server
            while chunk := response.read1(1 << 20):
                f.write(chunk)
                received += len(chunk)
                on_bytes(len(chunk))
                if stop.is_set():
                    raise Stopped()
                if time.monotonic() > deadline:
                    raise TransientError(f"deadline passed with {f.tell():,} bytes received")
    except urllib.error.HTTPError as e:
        if e.code == 416:  # our partial file no longer matches the server's: start over
            f.truncate(0)
            raise TransientError("HTTP 416: the partial file does not match the server's") from e
        if e.code in TRANSIENT_HTTP:
            raise TransientError(f"HTTP {e.code}", retry_after=e.headers.get("Retry-After")) from e
        raise DownloadError(f"HTTP {e.code} {e.reason}") from e
    except (OSError, HTTPException) as e:  # resets, drops, timeouts, DNS: all OSError subclasses
        raise TransientError(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from e
    if expected is not None and received != int(expected):
        raise TransientError(f"body cut short ({received} of {expected} bytes)")  # the next attempt resumes
    f.flush()
    os.fsync(f.fileno())
    if reason := problem(f.name):
        f.truncate(0)
        raise TransientError(reason)


def backoff_delay(attempt, base_delay, retry_after):
    """Exponential backoff with full jitter, so many ranks or workers don't retry in lockstep; Retry-After wins."""
    if retry_after is not None and retry_after.strip().isdigit():
        return min(float(retry_after), 120.0) + random.uniform(0, base_delay)
    return random.uniform(0, base_delay * 2 ** attempt)


def partial_path(final):
    return f"{final}{PARTIAL}{os.getpid()}"


def download_one(name, url, directory, stop, problem, shard_timeout, base_delay, max_attempts, on_bytes):
    """Fetch one file with retries before its deadline; it appears under its final name only once checked."""
    final = os.path.join(directory, name)
    tmp = partial_path(final)
    deadline = time.monotonic() + shard_timeout
    try:
        with open(tmp, "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # held while this process lives: remove_stale_partials leaves it alone
            for attempt in range(max_attempts):
                try:
                    fetch_into(f, url, deadline, stop, on_bytes, problem)
                    os.replace(tmp, final)
                    return final
                except TransientError as e:
                    if time.monotonic() >= deadline:
                        raise DownloadError(f"{name}: not complete after {shard_timeout:g} s ({e}) fetching {url}; "
                                            "the server is stalled or too slow: run again, or raise "
                                            "--shard_timeout") from e
                    if attempt == max_attempts - 1:
                        raise DownloadError(f"{name}: gave up after {max_attempts} attempts ({e}) fetching "
                                            f"{url}") from e
                    delay = backoff_delay(attempt, base_delay, e.retry_after)
                    if stop.wait(min(delay, max(0.0, deadline - time.monotonic()))):
                        raise Stopped() from e
                except DownloadError as e:
                    raise DownloadError(f"{name}: {e} fetching {url}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def remove_stale_partials(directory, pattern):
    """Delete the partial files (of names matching the glob pattern) of downloads that died (SIGKILL, power loss):
    the kernel dropped their lock."""
    removed = 0
    for path in glob.glob(os.path.join(directory, f"{pattern}{PARTIAL}*")):
        with contextlib.suppress(FileNotFoundError), open(path, "ab") as f:  # ab: NFS grants locks to writers only
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a download running now, in another process, owns it
            os.remove(path)
            removed += 1
    if removed:
        print(f"removed {removed} partial shard(s) left by an interrupted download", flush=True)


def run_in_threads(work, items, workers, stop):
    """work(item) for every item, on daemon threads: ThreadPoolExecutor joins its threads at exit, so Ctrl-C used to
    wait for every read in flight. On Ctrl-C, set stop and re-raise: no thread is waited for."""
    pending = queue.SimpleQueue()
    for item in items:
        pending.put(item)

    def loop():
        while not stop.is_set():
            try:
                item = pending.get_nowait()
            except queue.Empty:
                return
            work(item)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(max(1, min(workers, len(items))))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:
        stop.set()
        raise


def download_files(names, directory, url_of, problem, workers, shard_timeout, base_delay, max_attempts):
    """Fetch every name into directory, `workers` at a time; the failures' messages (empty when all arrived).

    url_of(name) is where a name is fetched from; problem(path) says why a fetched file is unusable (None: fine)."""
    files_bar = progress_bar(total=len(names), desc="files", unit="file", position=0)
    bytes_bar = progress_bar(desc="bytes", unit="B", unit_scale=True, position=1)
    stop, failures = threading.Event(), []

    def work(name):
        try:
            download_one(name, url_of(name), directory, stop, problem, shard_timeout, base_delay, max_attempts,
                         bytes_bar.update)
            files_bar.update(1)
        except DownloadError as e:
            failures.append(str(e))
        except (Stopped, OSError):  # OSError: Ctrl-C's cleanup removed the partial file under a finishing download
            if not stop.is_set():
                raise

    try:
        run_in_threads(work, names, workers, stop)
    except KeyboardInterrupt:
        for name in names:  # a thread still blocked in a read cannot clean up after itself before we exit
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial_path(os.path.join(directory, name)))
        raise
    finally:
        files_bar.close()
        bytes_bar.close()
    return failures
