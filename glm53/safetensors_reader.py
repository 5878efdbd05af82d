"""Read tensors from an HF safetensors checkpoint directory (single file or sharded).

Sharded checkpoints list `key -> file` in `model.safetensors.index.json`; a single-file checkpoint
is `model.safetensors` (any `*.safetensors` files in the directory are accepted without an index).
The safetensors container is a little-endian u64 header length, a JSON header
(`dtype`, `shape`, `data_offsets` per key) and the raw bytes. We read the header and memory-map
the data so that every dtype a GLM checkpoint uses — including `F8_E4M3`, which the
`safetensors` package's numpy front-end cannot return — comes back as a numpy array
(`ml_dtypes` provides bfloat16 and float8_e4m3fn).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model (names the key and the expected shape)."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


# A header larger than this is not a GLM checkpoint's (GLM-5.3's largest shard lists a few
# thousand tensors: well under 1 MiB of JSON).
_MAX_HEADER_BYTES = 100 * 2**20


def _read_header(path: str) -> tuple[dict, int, int]:
    """(the JSON header, the data section's offset in the file, the file's size). Raises CheckpointError naming the
    file when it is not a safetensors file or its header is cut short."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: not a safetensors file, or truncated: its header length is {n:,} bytes "
                                  f"and the file has {size:,}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file, or corrupt: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: its header is not a JSON object")
    return header, 8 + n, size


def _tensor_info(path: str, key: str, meta, base: int, size: int) -> TensorInfo:
    """One header entry → its TensorInfo. Raises CheckpointError naming the file and the key for a
    malformed entry, an unsupported dtype, a byte range that does not match the shape, or data
    past the end of the file (a truncated download)."""
    try:
        dtype, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: header entry {key!r} is malformed: {meta!r}") from None
    if dtype not in _DTYPES:
        raise CheckpointError(f"{path}: {key}: unsupported safetensors dtype {dtype}")
    want = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if not 0 <= b <= e or e - b != want:
        raise CheckpointError(f"{path}: {key}: data_offsets [{b}, {e}) hold {e - b:,} bytes; shape {list(shape)} "
                              f"of {dtype} needs {want:,}")
    if base + e > size:
        raise CheckpointError(f"{path} is truncated: tensor {key} needs bytes up to {base + e:,} and the file has "
                              f"{size:,} (an interrupted download or copy: fetch the file again)")
    return TensorInfo(path, dtype, shape, base + b, base + e)


class SafetensorsCheckpoint:
    """Lazy access to every tensor of a checkpoint directory by key."""

    def __init__(self, directory: str | os.PathLike):
        d = os.fspath(directory)
        if not os.path.isdir(d):
            raise FileNotFoundError(f"checkpoint directory not found: {d}")
        index = os.path.join(d, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a \"weight_map\" "
                                      f"of tensor name → file): {type(e).__name__}: {e}") from None
        else:
            files = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {d}")
        self.directory = d
        self.infos: dict[str, TensorInfo] = {}
        self._mmaps: dict[str, np.memmap] = {}
        for name in files:
            path = os.path.join(d, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{index} lists {name}, which does not exist")
            header, base, size = _read_header(path)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(key, name) != name:
                    continue  # the index reads this tensor from another file
                if key in self.infos:
                    raise CheckpointError(f"tensor {key} is in both {self.infos[key].file} and {path}, and no "
                                          "model.safetensors.index.json says which to read (remove the stale file)")
                self.infos[key] = _tensor_info(path, key, meta, base, size)
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in self.infos:
                    raise CheckpointError(f"{key}: listed in the index under {name} but absent from that file")

    def keys(self) -> list[str]:
        return sorted(self.infos)

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def shape(self, key: str) -> tuple[int, ...]:
        return self.infos[key].shape

    def dtype(self, key: str) -> str:
        return self.infos[key].dtype

    def release(self) -> None:
        """Drop the memory maps (re-opened on the next `get`): once no array read from them is
        alive, the pages they touched leave the process's resident set."""
        self._mmaps.clear()

    def get(self, key: str) -> np.ndarray:
        """The tensor as a (read-only, memory-mapped) numpy array."""
        try:
            info = self.infos[key]
        except KeyError:
            raise CheckpointError(f"{key}: missing from checkpoint {self.directory}") from None
        mm = self._mmaps.get(info.file)
        if mm is None:
            mm = self._mmaps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        dt = np.dtype(_DTYPES[info.dtype])
        return mm[info.begin:info.end].view(dt).reshape(info.shape)


class InMemoryCheckpoint(SafetensorsCheckpoint):
    """HF tensors held in a dict `key -> numpy array`, read through the checkpoint interface (the
    loader fills a model from generated weights without writing files)."""

    def __init__(self, tensors: dict[str, np.ndarray], directory: str = "<in-memory checkpoint>"):
        names = {np.dtype(v): k for k, v in _DTYPES.items()}
        self.directory = directory
        self.tensors = tensors
        self.infos = {k: TensorInfo("", names[np.dtype(v.dtype)], tuple(v.shape), 0, 0) for k, v in tensors.items()}
        self._mmaps = {}

    def get(self, key: str) -> np.ndarray:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"{key}: missing from checkpoint {self.directory}") from None
