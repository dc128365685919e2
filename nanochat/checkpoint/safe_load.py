"""
Reading a checkpoint's pickled files as data only: a checkpoint from a backup or another machine must not run code
when read. Rank files load with torch.load(weights_only=True) (and numpy's array reconstruction, for rank files that
predate plain RNG states: LEGACY_RANK_GLOBALS); a sharded checkpoint (torch.distributed.checkpoint) is read through
shard_reader, whose index unpickler admits only DCP's own classes and shard file names inside the checkpoint
directory, and shard_planner, which loads saved values with weights_only=True. A file holding anything else is
refused in one line naming what it holds (unreadable); checkpoint_manager and resume turn that into a CheckpointError.
"""

import functools
import io
import os
import pickle

import numpy as np
import torch

from nanochat.common import describe_error

NO_CHECKPOINT_DOES = "which no checkpoint does"  # in every refusal of a crafted file: --resume stops, never skips


class RefusedObject(pickle.UnpicklingError):
    """A checkpoint file names a Python object no checkpoint holds; the message is that object."""


def refused_object(error, source=None):
    """What a loader refused to build (RefusedObject's name, or the globals a torch file names that a weights_only
    load does not build), or None when the error is of another kind (a truncated file). source: the torch file (a
    path or file object) that failed to load."""
    if isinstance(error, RefusedObject):
        return str(error)
    if not isinstance(error, pickle.UnpicklingError):
        return None
    names = []
    if source is not None:
        try:  # torch's own opcode scan names every global without running one: its error text varies by module
            if hasattr(source, "seek"):
                source.seek(0)
            names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        except Exception:  # noqa: BLE001 - a file its scan cannot read names nothing; the text below may
            names = []
        unexpected = [n for n in names if n not in LEGACY_RANK_NAMES]
        names = unexpected or names
    if names:
        return ", ".join(names)
    text = str(error)
    if "WeightsUnpickler error:" in text:
        gist = next(line for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() + ["?"] if line.strip())
        return gist.strip().removeprefix("Unsupported global: GLOBAL ").split(" was not an allowed global")[0]
    if "Weights only load failed" in text:  # refused by weights_only, for a reason it words otherwise
        return "an object a weights_only load refuses"
    return None


def unreadable(path, error):
    """One line on a checkpoint file that failed to load: a refused object is said to be one, not damage."""
    refused = refused_object(error, path if os.path.isfile(str(path)) else None)
    if refused is None:
        return f"{path} is unreadable ({describe_error(error)})"
    return (f"{path} holds something other than tensors and plain data ({refused}), {NO_CHECKPOINT_DOES}, so it was "
            f"not read: the file was altered or is not a checkpoint; restore the checkpoint from a copy you trust, "
            f"or use another step")


# Rank files written before rng_state saved numpy's keys as a list hold a numpy array: numpy's own reconstruction of
# an array and its dtype, which build data and call nothing else (numpy 1 and 2 pickle the function under two names).
_reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]
LEGACY_RANK_GLOBALS = [(_reconstruct, f"{module}._reconstruct")
                       for module in ("numpy.core.multiarray", "numpy._core.multiarray")] + [
    np.ndarray, np.dtype, type(np.dtype(np.uint32))]
LEGACY_RANK_NAMES = {entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
                     for entry in LEGACY_RANK_GLOBALS}


# What torch.distributed.checkpoint pickles into a sharded checkpoint's index (.metadata), by module; torch dtypes
# (torch.float32, ...) are admitted by type in ShardIndexUnpickler.
SHARD_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                              "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout (torch.strided) by its name
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # Python >= 3.13
    "collections": {"OrderedDict"},
}


class ShardIndexUnpickler(pickle.Unpickler):
    """Unpickles a sharded checkpoint's .metadata admitting only the classes DCP writes there (SHARD_INDEX_GLOBALS)
    and torch dtypes: anything else, such as the os.system a crafted index names to run code, is a RefusedObject."""

    def find_class(self, module, name):
        if name in SHARD_INDEX_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # vars: no lazy imports
            return vars(torch)[name]
        raise RefusedObject(f"{module}.{name}")


@functools.cache
def _safe_shard_classes():
    """(reader, planner) classes over torch.distributed.checkpoint's, defined when a sharded checkpoint is first read:
    importing DCP costs seconds that loading a safetensors checkpoint need not pay."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader  # lazy: as the docstring says
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta  # lazy: as the docstring says

    class Reader(FileSystemReader):
        """FileSystemReader whose read_metadata unpickles the index with ShardIndexUnpickler: DCP's own calls
        pickle.load, so a crafted .metadata in a run directory (or a restored backup) would run code when read."""

        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = ShardIndexUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise RefusedObject(f"a {type(metadata).__name__} where DCP's Metadata belongs")
            for info in (metadata.storage_data or {}).values():  # DCP reads each shard at directory / its path
                name = getattr(info, "relative_path", None)
                if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
                        or "\\" in name:
                    raise RefusedObject(f"a shard path {name!r} that is not a file name in the checkpoint directory")
            if metadata.storage_meta is None:  # as DCP's own reader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values (AdamW's step) load with weights_only=True: DCP's own
        load_bytes unpickles them with weights_only=False, so a crafted .distcp file would run code."""

        def load_bytes(self, read_item, value):
            try:
                plain = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise RefusedObject(f"{refused_object(e, value)}, in {read_item.dest_index.fqn}'s value in a .distcp "
                                    f"file") from e
            # DCP's load_bytes puts the value in place; what it reads again is only what weights_only built
            again = io.BytesIO()
            torch.save(plain, again)
            again.seek(0)
            super().load_bytes(read_item, again)

    return Reader, Planner


def shard_reader(directory):
    """A torch.distributed.checkpoint reader of directory that refuses any object but DCP's own in its index."""
    return _safe_shard_classes()[0](directory)


def shard_planner():
    """A torch.distributed.checkpoint load planner that refuses any object but plain data in a saved value."""
    return _safe_shard_classes()[1]()


def load_shards(state, directory, **kwargs):
    """dcp.load of state from directory through shard_reader and shard_planner. DCP's CheckpointException (a
    BaseException whose message is every rank's traceback) is raised as its first rank's own error."""
    import torch.distributed.checkpoint as dcp  # lazy: DCP costs ~1 s to import, paid only by sharded checkpoints
    from torch.distributed.checkpoint.api import CheckpointException  # lazy: as dcp above
    try:
        dcp.load(state, storage_reader=shard_reader(directory), planner=shard_planner(), **kwargs)
    except CheckpointException as e:
        raise next(iter(e.failures.values()))[0] from e
