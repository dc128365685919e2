"""The pretraining corpus: parquet shards with a `text` column, in one directory.

Three ways to fill it, all giving the same shard format (the last shard is the validation shard):

    python -m nanochat.dataset -n 8 [-w 4]    # first 8 FineWeb-Edu shards + the validation shard, from the HF hub
    python -m nanochat.dataset --builtin      # no network: this Python's standard library (code + docstrings)
    python -m nanochat.dataset --synthetic=hops [--seed 0] [--synthetic_docs N] [--hops_max 4] ...  # generated
    python -m nanochat.dataset --from a.txt dir/ b.jsonl c.parquet [--skip_bad_lines]
    python -m nanochat.dataset --from hf:NAME[:config][:split] [--text_column text]   # a Hugging Face dataset

Imported files: a .txt file is one document (source files and essays keep their blank lines); a .jsonl file
has one JSON object with a string "text" field per line; a parquet file needs a string "text" column.
Undecodable bytes are replaced with U+FFFD and counted. hf:NAME is a dataset on the hub (streamed through the
`datasets` library, split "train" unless named) or a directory written by `datasets`' save_to_disk.
--text_column names the field or column holding the text, for jsonl, parquet and hf alike.

--synthetic writes a generated reasoning corpus (nanochat/data/synthetic.py, docs/reasoning.md), deterministic in its
flags.

A download keeps every complete shard and resumes a cut one where it stopped (HTTP Range); each shard has an overall
deadline (--shard_timeout). Ctrl-C stops at once and leaves no partial file; the same command then goes on.

Environment:
    NANOCHAT_DATA_DIR      shard directory (default $NANOCHAT_BASE_DIR/base_data)
    NANOCHAT_HF_ENDPOINT   hub endpoint or mirror to download from (falls back to HF_ENDPOINT, then huggingface.co)
"""

import argparse
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import signal
import sys
import sysconfig

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.cli import ArgumentParser, ExitCode
from nanochat.common import progress_bar, progress_enabled
from nanochat.data.download import (
    SHARD_TIMEOUT_S,
    DownloadError,
    download_files,
    hub_dataset_url,
    hub_endpoint,
    remove_stale_partials,
)
from nanochat.data.synthetic import SYNTHETIC_FAMILIES, HopsSpec, curriculum_documents, iter_hops_documents
from nanochat.files import atomic_write_bytes, fsync_dir, get_base_dir

REPO_ID = "karpathy/fineweb-edu-100b-shuffle"
MAX_SHARD = 1822  # shard_01822.parquet is the last shard of the repo, used for validation
CHARS_PER_SHARD = 10_000_000  # imported shards: ~10M chars each, so even a small corpus spans several files
ROW_GROUP_CHARS = 1_000_000  # ~250k tokens per row group: the unit DDP ranks split between them
MIN_ROW_GROUPS = 8  # per shard, so 8 ranks can share even a small validation shard
VAL_FRACTION = 0.02
SHUFFLE_SEED = 42
MANIFEST = "corpus.json"  # records where the shards came from, so two corpora never get mixed in one directory
SOURCE_FINEWEB = f"download: {REPO_ID}"
SYNTHETIC = "synthetic:"  # followed by the flags that regenerate the corpus, so rebuild_advice can repeat them
SYNTHETIC_DOCS = 200_000  # ~37 MB at the default spec's 185 chars (+1 <|bos|>) per document: minutes of CPU training
OFFLINE_HINT = ("if this machine is offline, build the built-in corpus with `python -m nanochat.dataset --builtin` "
                "or import your own text with `python -m nanochat.dataset --from PATH ...`")


class DatasetError(Exception):
    """Bad input or a failed download: the message says what went wrong and what to do."""


# -----------------------------------------------------------------------------
# Reading the shards (used by the tokenizer scripts and the dataloader)

def data_dir(create=True):
    """The corpus's directory; create=False: only its path (a dry run writes nothing)."""
    return os.environ.get("NANOCHAT_DATA_DIR") or os.path.join(get_base_dir(create), "base_data")


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


def unreadable_shard(path, error):
    return DatasetError(f"{path}: unreadable shard ({type(error).__name__}: {error}); "
                        f"{rebuild_advice(os.path.dirname(path))}")


def rebuild_advice(directory):
    """How to make the corpus in directory whole again, by where it came from (its manifest)."""
    source = read_source(directory) or ""
    command = ("--builtin" if source.startswith("builtin:") else
               "--from " + " ".join(source[len("import:"):].strip().split(", ")) if source.startswith("import:") else
               source[len(SYNTHETIC):].strip() if source.startswith(SYNTHETIC) else None)
    if command:
        return (f"rebuild the corpus: delete the .parquet files in {directory}, then run "
                f"python -m nanochat.dataset {command}")
    return "delete it and download it again (python -m nanochat.dataset -n N fetches missing shards)"


def row_group_sizes(path):
    """Documents per row group of a shard, from its footer."""
    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, ValueError, pa.ArrowException) as e:
        raise unreadable_shard(path, e) from e
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def read_texts(path, group):
    """The documents of one row group of a shard."""
    try:
        return pq.ParquetFile(path).read_row_group(group, columns=["text"]).column("text").to_pylist()
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise unreadable_shard(path, e) from e


def iter_documents(split, data_dir=None):
    """Yield every document of a split, in shard and row-group order."""
    for path in parquets_for_split(split, data_dir):
        for group in range(len(row_group_sizes(path))):
            yield from read_texts(path, group)


def corpus_identity(data_dir=None):
    """What identifies the corpus, from parquet footers only (no text is read): a short hash of every shard's name,
    size and documents per row group, with the directory and the shard count; a copy of the same files elsewhere
    hashes the same."""
    directory = resolve_dir(data_dir)
    paths = list_parquet_files(directory)
    shards = [[os.path.basename(path), os.path.getsize(path), row_group_sizes(path)] for path in paths]
    fingerprint = hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:12]
    return {"fingerprint": fingerprint, "dir": os.path.abspath(directory), "shards": len(paths)}


def is_readable_shard(path):
    """A parquet footer that parses and a text column: a truncated or foreign file fails this."""
    try:
        return "text" in pq.ParquetFile(path).schema_arrow.names
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        return False


def shard_problem(path):
    """Why a downloaded file is not a usable shard (None when it is): the downloader refetches it."""
    return None if is_readable_shard(path) else "not a readable parquet file with a text column"


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
                       f"{read_source(directory) or 'an unrecorded corpus'}; remove its .parquet files, or set "
                       "NANOCHAT_DATA_DIR to another directory")


# -----------------------------------------------------------------------------
# Download from the hub (the HTTP machinery is nanochat/data/download.py's)

def shard_name(index):
    return f"shard_{index:05d}.parquet"


def download_shards(n, workers=4, base_delay=1.0, max_attempts=6, shard_timeout=SHARD_TIMEOUT_S, data_dir=None):
    """Download the first n FineWeb-Edu shards plus the validation shard; complete shards are kept, so it resumes."""
    if n < 1:
        raise DatasetError(f"-n must be at least 1, got {n}")
    if not shard_timeout > 0:
        raise DatasetError(f"--shard_timeout must be a positive number of seconds, got {shard_timeout}")
    hub_endpoint()  # a malformed endpoint fails here, before anything is created
    directory = resolve_dir(data_dir)
    # no record: shards from an older nanochat download; a record without shards is stale
    if list_parquet_files(directory) and read_source(directory) not in (None, SOURCE_FINEWEB):
        refuse_to_mix(directory)
    os.makedirs(directory, exist_ok=True)
    remove_stale_partials(directory, "shard_*.parquet")
    names = [shard_name(i) for i in sorted(set(range(min(n, MAX_SHARD))) | {MAX_SHARD})]
    todo = [name for name in names if not is_readable_shard(os.path.join(directory, name))]
    print(f"{len(names) - len(todo)} of {len(names)} shards already complete in {directory}", flush=True)
    try:
        failures = download_files(todo, directory, functools.partial(hub_dataset_url, REPO_ID), shard_problem,
                                  workers, shard_timeout, base_delay, max_attempts)
    finally:
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


def jsonl_text(line, column):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line is not valid JSON ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get(column), str):
        raise ValueError(f'line has no string "{column}" field')
    return record[column]


def read_jsonl(path, column, stats, skip_bad_lines):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = decode_counting(raw, stats)
            if not line.strip():
                continue
            try:
                text = jsonl_text(line, column)
            except ValueError as e:
                if not skip_bad_lines:
                    raise DatasetError(f"{path}:{lineno}: {e}; fix it, or pass --skip_bad_lines to skip such lines "
                                       "(--text_column names another field)") from e
                stats["skipped"] += 1
                continue
            yield text


def read_parquet(path, column):
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(columns=[column]):
        yield from (text for text in batch.column(column).to_pylist() if text is not None)


def check_parquet(path, column):
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    if column not in schema.names or str(schema.field(column).type) not in ("string", "large_string"):
        raise DatasetError(f"{path}: needs a string column named '{column}' (--text_column); its columns are: "
                           f"{', '.join(f'{f.name} ({f.type})' for f in schema)}")


def saved_by_datasets(path):
    """A directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return any(os.path.exists(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def load_hf(spec, column):
    """hf:NAME[:config][:split] -> a datasets Dataset, after checking that its text column exists and holds text."""
    fields = spec[len("hf:"):].split(":")
    if len(fields) > 3 or not fields[0]:
        raise DatasetError(f"{spec}: expected hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT")
    name, config, split = (fields + ["", ""])[:3]
    import datasets  # lazy: the datasets package costs ~1.2 s to import, and only --from hf: needs it
    try:
        if os.path.isdir(name) and saved_by_datasets(name):
            if config:
                raise DatasetError(f"{spec}: a directory written by save_to_disk has no configs; drop :{config}")
            data = datasets.load_from_disk(name)
            if isinstance(data, datasets.DatasetDict):
                if (split or "train") not in data:
                    raise DatasetError(f"{spec}: no split {split or 'train'!r}; it has {', '.join(data)}")
                data = data[split or "train"]
            elif split:
                raise DatasetError(f"{spec}: {name} holds a single split; drop :{split}")
        else:
            # streamed: rows go straight into our shards, instead of a second full copy in the HF cache
            data = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except (OSError, ValueError) as e:  # not found, offline, bad config or split: datasets says which
        raise DatasetError(f"{spec}: {type(e).__name__}: {e}") from e
    features = data.features or {}  # a streamed dataset may not know its columns before the first row
    if features and column not in features:
        raise DatasetError(f"{spec}: no column {column!r}; its columns are: {', '.join(features)} "
                           "(pick one with --text_column)")
    if column in features and getattr(features[column], "dtype", None) not in ("string", "large_string"):
        raise DatasetError(f"{spec}: column {column!r} holds {features[column]}, not text (pick another with "
                           "--text_column)")
    return data


def read_hf(spec, data, column):
    for batch in data.select_columns([column]).iter(batch_size=1000):
        for text in batch[column]:
            if text is not None and not isinstance(text, str):
                raise DatasetError(f"{spec}: column {column!r} holds {type(text).__name__}, not text")
            if text is not None:
                yield text


SUFFIXES = (".txt", ".jsonl", ".parquet")


def expand_inputs(paths):
    """Files and hf: datasets to import, in a stable order; directories contribute every importable file below."""
    files = []
    for path in paths:
        if path.startswith("hf:"):
            files.append(path)
        elif os.path.isdir(path):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(SUFFIXES))
            if not found:
                raise DatasetError(f"{path}: directory holds no {', '.join(SUFFIXES)} files")
            files += found
        elif not os.path.exists(path):
            raise DatasetError(f"{path}: no such file or directory")
        elif not path.endswith(SUFFIXES):
            raise DatasetError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}, or hf:NAME")
        else:
            files.append(path)
    return files


def document_readers(files, column, stats, skip_bad_lines):
    """One document generator per input; parquet schemas and hf datasets are checked here, before any reading."""
    readers = []
    for path in files:
        if path.startswith("hf:"):
            readers.append(functools.partial(read_hf, path, load_hf(path, column), column))
        elif path.endswith(".txt"):
            readers.append(functools.partial(read_txt, path, stats))
        elif path.endswith(".jsonl"):
            readers.append(functools.partial(read_jsonl, path, column, stats, skip_bad_lines))
        else:
            check_parquet(path, column)
            readers.append(functools.partial(read_parquet, path, column))
    return readers


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


def write_shards(documents, stats, directory, first=None, total=None):
    """Shuffle, hold out a validation share, and write the shards into `directory` (val is the last file). `first`:
    documents that open the training split in their own order, in place of as many shuffled ones (a curriculum; the
    validation share is the same as without them). total: how many documents are coming, when known (for the
    progress line)."""
    import datasets  # lazy: the datasets package costs ~1.2 s to import, and only --from hf: needs it
    from datasets.exceptions import DatasetGenerationError  # lazy: as datasets above
    datasets.enable_progress_bars() if progress_enabled() else datasets.disable_progress_bars()
    try:
        # datasets keeps the corpus in a memory-mapped arrow cache, so imports larger than RAM still shuffle
        # a fixed fingerprint: the cache directory is fresh, and a generator object cannot be hashed anyway
        documents = progress_bar(documents, total=total, desc="reading documents", unit="documents")
        ds = datasets.Dataset.from_generator(lambda: keep_nonempty(documents, stats), fingerprint="corpus",
                                             features=datasets.Features({"text": datasets.Value("string")}),
                                             cache_dir=os.path.join(directory, "cache"))
    except DatasetGenerationError as e:
        raise (e.__cause__ or e) from None  # the reader's own error names the file and line; the wrapper doesn't
    print(f"read {stats['docs']:,} documents; shuffling them, holding out validation, writing shards", flush=True)
    n_val = max(1, round(VAL_FRACTION * stats["docs"]))
    split = ds.train_test_split(test_size=n_val, seed=SHUFFLE_SEED)
    if first is not None:
        head = datasets.Dataset.from_generator(lambda: ({"text": text} for text in first), fingerprint="first",
                                               features=ds.features, cache_dir=os.path.join(directory, "cache"))
        if len(head) > len(split["train"]):
            raise DatasetError(f"{len(head):,} curriculum documents but only {len(split['train']):,} training "
                               "documents: raise the corpus's size or lower the curriculum")
        rest = split["train"].select(range(len(head), len(split["train"])))
        split["train"] = datasets.concatenate_datasets([head, rest])
    rows_per_group = max(1, ROW_GROUP_CHARS * stats["docs"] // max(1, stats["chars"]))
    # a few huge documents: never more shards than documents (datasets' shard() fails on an empty one)
    num_train = min(len(split["train"]), max(1, math.ceil(stats["chars"] * (1 - VAL_FRACTION) / CHARS_PER_SHARD)))
    parts = [split["train"].shard(num_train, i, contiguous=True) for i in range(num_train)] + [split["test"]]
    for i, part in enumerate(parts):
        batch_size = max(1, min(rows_per_group, len(part) // MIN_ROW_GROUPS))
        part.to_parquet(os.path.join(directory, shard_name(i)), batch_size=batch_size)
    shutil.rmtree(os.path.join(directory, "cache"))
    return len(parts)


def build_corpus(documents, stats, source, directory=None, first=None, total=None):
    """Write a whole corpus into a staging directory, then move it into place: bad input leaves nothing behind."""
    directory = resolve_dir(directory)
    staging = f"{directory}.tmp{os.getpid()}"
    try:
        os.makedirs(staging)
        num_shards = write_shards(documents, stats, staging, first, total)
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
    build_corpus(builtin_documents(stats), stats, source, directory, total=len(stdlib_files()))


def synthetic_flags(family, seed, docs, spec, curriculum=0):
    """The command-line flags that generate a synthetic corpus: its recorded source, and what --hops reads back."""
    return (f"--synthetic={family} --seed={seed} --synthetic_docs={docs} --hops_symbols={spec.n_symbols} "
            f"--hops_max={spec.max_hops} --hops_queries={spec.n_queries}" +
            (f" --hops_curriculum={curriculum}" if curriculum else ""))


HOPS_FLAGS = {"n_symbols": "--hops_symbols", "max_hops": "--hops_max", "n_queries": "--hops_queries"}


def build_synthetic(family, seed=0, docs=SYNTHETIC_DOCS, n_symbols=16, max_hops=4, n_queries=24, directory=None,
                    curriculum=0):
    """A generated corpus through the same shuffle, validation hold-out and shards as --builtin; `curriculum` > 0
    opens the training split with that many documents of fewer hops, 1 first (synthetic.curriculum_documents)."""
    if family not in SYNTHETIC_FAMILIES:
        raise DatasetError(f"--synthetic={family}: unknown family; known: {', '.join(SYNTHETIC_FAMILIES)}")
    if docs < 2:
        raise DatasetError(f"--synthetic_docs={docs}: need at least 2 (one is held out for validation)")
    if curriculum < 0 or (curriculum and max_hops < 2):
        raise DatasetError(f"--hops_curriculum={curriculum}: must be >= 0, and needs --hops_max >= 2 (it opens with "
                           "documents of fewer hops than --hops_max)")
    try:
        spec = HopsSpec(n_symbols=n_symbols, max_hops=max_hops, n_queries=n_queries)
        next(iter_hops_documents(seed, 1, spec, family))  # a family's own limits, before anything is written
    except ValueError as e:  # HopsSpec names its fields; the user typed the flags
        message = str(e)
        for field, flag in HOPS_FLAGS.items():
            message = message.replace(field, flag)
        raise DatasetError(message) from None
    source = f"{SYNTHETIC} {synthetic_flags(family, seed, docs, spec, curriculum)}"
    directory = resolve_dir(directory)
    if list_parquet_files(directory) and read_source(directory) == source:
        print(f"{directory} already holds this corpus ({source}); nothing to do")
        return
    if list_parquet_files(directory):
        refuse_to_mix(directory)  # before generating: build_corpus would refuse only after writing it all
    stats = new_stats()
    first = curriculum_documents(seed, curriculum, spec, family) if curriculum else None
    build_corpus(iter_hops_documents(seed, docs, spec, family), stats, source, directory, first, total=docs)


def import_corpus(paths, skip_bad_lines=False, directory=None, text_column="text"):
    stats = new_stats()
    readers = document_readers(expand_inputs(paths), text_column, stats, skip_bad_lines)
    source = "import: " + ", ".join(p if p.startswith("hf:") else os.path.abspath(p) for p in paths)
    build_corpus(itertools.chain.from_iterable(read() for read in readers), stats, source, directory)


def main(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("-n", "--num_shards", type=int, help="download the first N FineWeb-Edu shards (+ the val shard)")
    mode.add_argument("--builtin", action="store_true", help="build the offline corpus from Python's standard library")
    mode.add_argument("--from", dest="paths", nargs="+", metavar="PATH",
                      help=".txt/.jsonl/.parquet files or dirs, or hf:NAME[:config][:split]")
    mode.add_argument("--synthetic", metavar="FAMILY",
                      help="generate a reasoning corpus: hops (chained lookups in a permutation table) or "
                           "hops_pairs (the same, one character per table entry; --hops_symbols<=8); "
                           "docs/reasoning.md")
    parser.add_argument("--seed", type=int, default=0,
                        help="--synthetic: the corpus is a function of this and the spec")
    parser.add_argument("--synthetic_docs", type=int, default=SYNTHETIC_DOCS,
                        help=f"--synthetic: documents (default {SYNTHETIC_DOCS:,}: ~37 MB, ~37M byte-level tokens "
                             "at the default spec; raise it to train longer without repeating)")
    parser.add_argument("--hops_symbols", type=int, default=16, help="hops: symbols in the table, 2..26 (chance 1/N)")
    parser.add_argument("--hops_max", type=int, default=4, help="hops: queries need 1..this many lookups, 1..9")
    parser.add_argument("--hops_queries", type=int, default=24, help="hops: queries (answers) per document")
    parser.add_argument("--hops_curriculum", type=int, default=0, metavar="DOCS",
                        help="hops: open the training split with DOCS documents of fewer hops in order (1 hop, then "
                             "up to 2, ... up to --hops_max - 1), in place of as many shuffled ones; 0 = none")
    parser.add_argument("-w", "--workers", type=int, default=4, help="parallel downloads")
    parser.add_argument("--shard_timeout", type=float, default=SHARD_TIMEOUT_S,
                        help="seconds one shard may take, retries included")
    parser.add_argument("--skip_bad_lines", action="store_true", help="skip (and count) bad jsonl lines")
    parser.add_argument("--text_column", default="text", help="jsonl field, parquet or hf column holding the text")
    args = parser.parse_args(argv)
    try:
        if args.builtin:
            build_builtin()
        elif args.paths:
            import_corpus(args.paths, args.skip_bad_lines, text_column=args.text_column)
        elif args.synthetic is not None:
            build_synthetic(args.synthetic, args.seed, args.synthetic_docs, args.hops_symbols, args.hops_max,
                            args.hops_queries, curriculum=args.hops_curriculum)
        else:
            download_shards(args.num_shards, workers=args.workers, shard_timeout=args.shard_timeout)
    except (DatasetError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.FAILED
    except KeyboardInterrupt:
        print("interrupted: no partial file is left (complete shards are kept); run the same command again to go on",
              file=sys.stderr)
        return ExitCode.SIGNALED + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
