"""The pretraining corpus: parquet shards with a `text` column, in one directory.

Three ways to fill it, all giving the same shard format (the last shard is the validation shard):

    python -m nanochat.dataset -n 8 [-w 4]    # first 8 FineWeb-Edu shards + the validation shard, from the HF hub
    python -m nanochat.dataset --builtin      # no network: this Python's standard library (code + docstrings)
    python -m nanochat.dataset --from a.txt dir/ b.jsonl c.parquet [--skip_bad_lines]

Imported files: a .txt file is one document (source files and essays keep their blank lines); a .jsonl file
has one JSON object with a string "text" field per line; a parquet file needs a string "text" column.
Undecodable bytes are replaced with U+FFFD and counted.

Environment:
    NANOCHAT_DATA_DIR      shard directory (default $NANOCHAT_BASE_DIR/base_data)
    NANOCHAT_HF_ENDPOINT   hub endpoint or mirror to download from (falls back to HF_ENDPOINT, then huggingface.co)
"""

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException

import pyarrow.parquet as pq

from nanochat.cli import ArgumentParser
from nanochat.common import atomic_write_bytes, fsync_dir, get_base_dir

REPO_ID = "karpathy/fineweb-edu-100b-shuffle"
MAX_SHARD = 1822  # shard_01822.parquet is the last shard of the repo, used for validation
CHARS_PER_SHARD = 10_000_000  # imported shards: ~10M chars each, so even a small corpus spans several files
ROW_GROUP_CHARS = 1_000_000  # ~250k tokens per row group: the unit DDP ranks split between them
MIN_ROW_GROUPS = 8  # per shard, so 8 ranks can share even a small validation shard
VAL_FRACTION = 0.02
SHUFFLE_SEED = 42
TIMEOUT_S = 30  # per connect and per read: a stalled connection fails instead of hanging every rank
TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
MANIFEST = "corpus.json"  # records where the shards came from, so two corpora never get mixed in one directory
SOURCE_FINEWEB = f"download: {REPO_ID}"
OFFLINE_HINT = ("if this machine is offline, build the built-in corpus with `python -m nanochat.dataset --builtin` "
                "or import your own text with `python -m nanochat.dataset --from PATH ...`")


class DatasetError(Exception):
    """Bad input or a failed download: the message says what went wrong and what to do."""


# -----------------------------------------------------------------------------
# Reading the shards (used by the tokenizer scripts and the dataloader)

def data_dir():
    return os.environ.get("NANOCHAT_DATA_DIR") or os.path.join(get_base_dir(), "base_data")


def resolve_dir(directory):
    """The argument if given, else the configured shard directory (parameters named data_dir hide data_dir())."""
    return directory or data_dir()


def list_parquet_files(data_dir=None):
    directory = resolve_dir(data_dir)
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".parquet"))


def parquets_for_split(split, data_dir=None):
    """train = every shard but the last, val = the last one."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    paths = list_parquet_files(data_dir)
    if len(paths) < 2:
        raise DatasetError(f"found {len(paths)} parquet shard(s) in {resolve_dir(data_dir)}, need at least 2 "
                           "(train + val). Create them with `python -m nanochat.dataset --builtin` (offline) "
                           "or `python -m nanochat.dataset -n 8` (FineWeb-Edu download)")
    return paths[:-1] if split == "train" else paths[-1:]


def iter_documents(split, data_dir=None):
    """Yield every document of a split, in shard and row-group order."""
    for path in parquets_for_split(split, data_dir):
        pf = pq.ParquetFile(path)
        for group in range(pf.num_row_groups):
            yield from pf.read_row_group(group, columns=["text"]).column("text").to_pylist()


def is_readable_shard(path):
    """A parquet footer that parses and a text column: a truncated or foreign file fails this."""
    try:
        return "text" in pq.ParquetFile(path).schema_arrow.names
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        return False


# -----------------------------------------------------------------------------
# One directory holds one corpus

def read_source(directory):
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["source"]


def write_source(directory, source):
    atomic_write_bytes(os.path.join(directory, MANIFEST), json.dumps({"source": source}).encode())


def refuse_to_mix(directory):
    """Shards of two corpora in one directory would silently be trained on together."""
    raise DatasetError(f"{directory} already holds {len(list_parquet_files(directory))} shard(s) of "
                       f"{read_source(directory) or 'an unrecorded corpus'}; remove them, or set NANOCHAT_DATA_DIR "
                       "to another directory")


# -----------------------------------------------------------------------------
# Download from the hub

def shard_name(index):
    return f"shard_{index:05d}.parquet"


def hub_endpoint():
    endpoint = os.environ.get("NANOCHAT_HF_ENDPOINT") or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    return endpoint.rstrip("/")


def shard_url(name):
    from huggingface_hub import hf_hub_url  # resolves the hub's URL layout for a dataset file
    return hf_hub_url(REPO_ID, name, repo_type="dataset", endpoint=hub_endpoint())


class TransientError(Exception):
    def __init__(self, reason, retry_after=None):
        super().__init__(reason)
        self.retry_after = retry_after


def fetch_to(url, tmp_path, on_bytes):
    """GET url into tmp_path. Raises TransientError for what a retry may fix, DatasetError for what it won't."""
    request = urllib.request.Request(url, headers={"User-Agent": "nanochat"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(tmp_path, "wb") as f:
            expected = response.headers.get("Content-Length")
            received = 0
            while chunk := response.read(1 << 20):
                f.write(chunk)
                received += len(chunk)
                on_bytes(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    except urllib.error.HTTPError as e:
        if e.code in TRANSIENT_HTTP:
            raise TransientError(f"HTTP {e.code}", retry_after=e.headers.get("Retry-After")) from e
        raise DatasetError(f"HTTP {e.code} {e.reason}") from e
    except (OSError, HTTPException) as e:  # resets, drops, timeouts, DNS: all OSError subclasses
        raise TransientError(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from e
    if expected is not None and received != int(expected):
        raise TransientError(f"body cut short ({received} of {expected} bytes)")
    if not is_readable_shard(tmp_path):
        raise TransientError("not a readable parquet file with a text column")


def backoff_delay(attempt, base_delay, retry_after):
    """Exponential backoff with full jitter, so many ranks or workers don't retry in lockstep; Retry-After wins."""
    if retry_after is not None and retry_after.strip().isdigit():
        return min(float(retry_after), 120.0) + random.uniform(0, base_delay)
    return random.uniform(0, base_delay * 2 ** attempt)


def download_one(name, directory, base_delay, max_attempts, on_bytes):
    """Fetch one shard with retries; it appears under its final name only once verified."""
    url = shard_url(name)
    final = os.path.join(directory, name)
    tmp = f"{final}.tmp{os.getpid()}"
    try:
        for attempt in range(max_attempts):
            try:
                fetch_to(url, tmp, on_bytes)
                os.replace(tmp, final)
                return final
            except TransientError as e:
                if attempt == max_attempts - 1:
                    raise DatasetError(f"{name}: gave up after {max_attempts} attempts ({e}) fetching {url}") from e
                time.sleep(backoff_delay(attempt, base_delay, e.retry_after))
            except DatasetError as e:
                raise DatasetError(f"{name}: {e} fetching {url}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def download_shards(n, workers=4, base_delay=1.0, max_attempts=6, data_dir=None):
    """Download the first n FineWeb-Edu shards plus the validation shard; complete shards are kept, so it resumes."""
    from tqdm import tqdm
    if n < 1:
        raise DatasetError(f"-n must be at least 1, got {n}")
    directory = resolve_dir(data_dir)
    os.makedirs(directory, exist_ok=True)
    if read_source(directory) not in (None, SOURCE_FINEWEB):  # no record: shards from an older nanochat download
        refuse_to_mix(directory)
    names = [shard_name(i) for i in sorted(set(range(min(n, MAX_SHARD))) | {MAX_SHARD})]
    todo = [name for name in names if not is_readable_shard(os.path.join(directory, name))]
    print(f"{len(names) - len(todo)} of {len(names)} shards already complete in {directory}", flush=True)
    files_bar = tqdm(total=len(todo), desc="files", unit="file", position=0)
    bytes_bar = tqdm(desc="bytes", unit="B", unit_scale=True, position=1)
    failures = []

    def work(name):
        try:
            download_one(name, directory, base_delay, max_attempts, bytes_bar.update)
            files_bar.update(1)
        except DatasetError as e:
            failures.append(str(e))

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(work, todo))
    files_bar.close()
    bytes_bar.close()
    if list_parquet_files(directory):
        write_source(directory, SOURCE_FINEWEB)
    fsync_dir(directory)
    if failures:
        raise DatasetError(f"{len(failures)} of {len(todo)} downloads failed:\n  " + "\n  ".join(sorted(failures)) +
                           f"\n{OFFLINE_HINT}")
    return [os.path.join(directory, name) for name in names]


# -----------------------------------------------------------------------------
# Building shards from local text (--builtin, --from)

def decode_counting(raw, stats):
    """UTF-8 decode with U+FFFD for bad bytes; a genuine U+FFFD in the input is not counted as a replacement."""
    text = raw.decode("utf-8", errors="replace")
    stats["replaced"] += text.count("\ufffd") - raw.count("\ufffd".encode())
    return text


def read_txt(path, stats):
    with open(path, "rb") as f:
        yield decode_counting(f.read(), stats)


def jsonl_text(line):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line is not valid JSON ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError('line has no string "text" field')
    return record["text"]


def read_jsonl(path, stats, skip_bad_lines):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = decode_counting(raw, stats)
            if not line.strip():
                continue
            try:
                text = jsonl_text(line)
            except ValueError as e:
                if not skip_bad_lines:
                    raise DatasetError(f"{path}:{lineno}: {e}; fix it, or pass --skip_bad_lines to skip "
                                       "such lines") from e
                stats["skipped"] += 1
                continue
            yield text


def read_parquet(path):
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(columns=["text"]):
        yield from (text for text in batch.column("text").to_pylist() if text is not None)


def check_parquet(path):
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    if "text" not in schema.names or str(schema.field("text").type) not in ("string", "large_string"):
        raise DatasetError(f"{path}: needs a string column named 'text'; its columns are: "
                           f"{', '.join(f'{f.name} ({f.type})' for f in schema)}")


SUFFIXES = (".txt", ".jsonl", ".parquet")


def expand_inputs(paths):
    """Files to import, in a stable order; directories contribute every importable file below them."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(SUFFIXES))
            if not found:
                raise DatasetError(f"{path}: directory holds no {', '.join(SUFFIXES)} files")
            files += found
        elif not os.path.exists(path):
            raise DatasetError(f"{path}: no such file or directory")
        elif not path.endswith(SUFFIXES):
            raise DatasetError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}")
        else:
            files.append(path)
    for path in files:
        if path.endswith(".parquet"):
            check_parquet(path)  # metadata only: fail before any reading starts
    return files


def import_documents(files, stats, skip_bad_lines):
    for path in files:
        if path.endswith(".txt"):
            yield from read_txt(path, stats)
        elif path.endswith(".jsonl"):
            yield from read_jsonl(path, stats, skip_bad_lines)
        else:
            yield from read_parquet(path)


def stdlib_files():
    """The running Python's standard library sources, relative-path sorted so the corpus is deterministic."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, fs in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        # _sysconfigdata holds the build machine's paths: it would make two installs of one version differ
        files += [os.path.join(d, f) for f in fs if f.endswith((".py", ".txt")) and not f.startswith("_sysconfigdata")]
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def builtin_documents(stats):
    for path in stdlib_files():
        yield from read_txt(path, stats)


def keep_nonempty(documents, stats):
    """Blank documents carry no text to learn from; count what is kept for shard sizing."""
    for text in documents:
        if text.strip():
            stats["docs"] += 1
            stats["chars"] += len(text)
            yield {"text": text}
    if stats["docs"] < 2:
        raise DatasetError(f"the corpus has {stats['docs']} non-empty document(s); need at least 2 "
                           "(one is held out for validation)")


def write_shards(documents, stats, directory):
    """Shuffle, hold out a validation share, and write the shards into `directory` (val is the last file)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError
    datasets.disable_progress_bars()
    try:
        # datasets keeps the corpus in a memory-mapped arrow cache, so imports larger than RAM still shuffle
        # a fixed fingerprint: the cache directory is fresh, and a generator object cannot be hashed anyway
        ds = datasets.Dataset.from_generator(lambda: keep_nonempty(documents, stats), fingerprint="corpus",
                                             features=datasets.Features({"text": datasets.Value("string")}),
                                             cache_dir=os.path.join(directory, "cache"))
    except DatasetGenerationError as e:
        raise (e.__cause__ or e) from None  # the reader's own error names the file and line; the wrapper doesn't
    n_val = max(1, round(VAL_FRACTION * stats["docs"]))
    split = ds.train_test_split(test_size=n_val, seed=SHUFFLE_SEED)
    rows_per_group = max(1, ROW_GROUP_CHARS * stats["docs"] // max(1, stats["chars"]))
    num_train = max(1, math.ceil(stats["chars"] * (1 - VAL_FRACTION) / CHARS_PER_SHARD))
    parts = [split["train"].shard(num_train, i, contiguous=True) for i in range(num_train)] + [split["test"]]
    for i, part in enumerate(parts):
        batch_size = max(1, min(rows_per_group, len(part) // MIN_ROW_GROUPS))
        part.to_parquet(os.path.join(directory, shard_name(i)), batch_size=batch_size)
    shutil.rmtree(os.path.join(directory, "cache"))
    return len(parts)


def build_corpus(documents, stats, source, directory=None):
    """Write a whole corpus into a staging directory, then move it into place: bad input leaves nothing behind."""
    directory = resolve_dir(directory)
    staging = f"{directory}.tmp{os.getpid()}"
    try:
        os.makedirs(staging)
        num_shards = write_shards(documents, stats, staging)
        if list_parquet_files(directory):
            refuse_to_mix(directory)
        os.makedirs(directory, exist_ok=True)
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(directory, name))
        write_source(directory, source)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {num_shards} shards ({stats['docs']:,} documents, {stats['chars']:,} chars) to {directory}")
    if stats["replaced"]:
        print(f"note: replaced {stats['replaced']:,} undecodable byte sequence(s) with U+FFFD")
    if stats["skipped"]:
        print(f"note: skipped {stats['skipped']:,} bad jsonl line(s)")
    return num_shards


def new_stats():
    return {"docs": 0, "chars": 0, "replaced": 0, "skipped": 0}


def build_builtin(directory=None):
    source = f"builtin: Python {platform.python_version()} standard library"
    directory = resolve_dir(directory)
    if list_parquet_files(directory) and read_source(directory) == source:
        print(f"{directory} already holds the built-in corpus; nothing to do")
        return
    stats = new_stats()
    build_corpus(builtin_documents(stats), stats, source, directory)


def import_corpus(paths, skip_bad_lines=False, directory=None):
    files = expand_inputs(paths)
    stats = new_stats()
    source = "import: " + ", ".join(os.path.abspath(p) for p in paths)
    build_corpus(import_documents(files, stats, skip_bad_lines), stats, source, directory)


def main(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("-n", "--num_shards", type=int, help="download the first N FineWeb-Edu shards (+ the val shard)")
    mode.add_argument("--builtin", action="store_true", help="build the offline corpus from Python's standard library")
    mode.add_argument("--from", dest="paths", nargs="+", metavar="PATH", help=".txt/.jsonl/.parquet files or dirs")
    parser.add_argument("-w", "--workers", type=int, default=4, help="parallel downloads")
    parser.add_argument("--skip_bad_lines", action="store_true", help="skip (and count) bad jsonl lines")
    args = parser.parse_args(argv)
    try:
        if args.builtin:
            build_builtin()
        elif args.paths:
            import_corpus(args.paths, args.skip_bad_lines)
        else:
            download_shards(args.num_shards, workers=args.workers)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
