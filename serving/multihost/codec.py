"""Step inputs ↔ bytes for the leader → follower channel.

A step's host inputs are numpy arrays inside a few dataclasses, dicts and tuples
(`serving.runner.StepInputs`: the `ForwardBatch`, the sampling/copy arrays, the `SpecBatch`).
`encode` turns such a tree into msgpack (msgspec): an array becomes `[dtype, shape, raw bytes]`
(C order), a dataclass its class name and fields; `decode` rebuilds it with the same dtypes,
shapes and classes. Only the classes registered in `DATACLASSES` cross the channel; anything
else raises TypeError on the sending side, so a new step input cannot be dropped silently.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from glm53.batch import ForwardBatch
from glm53.hot_cache import HotBatch
from serving.spec_decode.inputs import SpecBatch
from serving.step_inputs import StepInputs

DATACLASSES = {cls.__name__: cls for cls in (StepInputs, ForwardBatch, SpecBatch, HotBatch)}


def _pack(x):
    if isinstance(x, (np.ndarray, np.generic)):
        a = np.asarray(x)  # (not ascontiguousarray: it makes a 0-d array 1-d)
        return {"a": [a.dtype.str, list(a.shape), a.tobytes(order="C")]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"v": x}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = type(x).__name__
        if DATACLASSES.get(name) is not type(x):
            raise TypeError(f"{name} is not a step-input class of the multi-host channel (codec.DATACLASSES)")
        return {"d": name, "f": {f.name: _pack(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, dict):
        return {"m": [[k, _pack(v)] for k, v in x.items()]}
    if isinstance(x, (tuple, list)):
        return {"t": [_pack(v) for v in x]}
    raise TypeError(f"cannot send a {type(x).__name__} over the multi-host channel (numpy arrays, dataclasses "
                    "of codec.DATACLASSES, dicts, tuples and scalars only)")


def _unpack(x):
    if "a" in x:
        dtype, shape, raw = x["a"]
        a = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        return a.copy()  # writable, owned (the message buffer is not kept)
    if "v" in x:
        return x["v"]
    if "d" in x:
        return DATACLASSES[x["d"]](**{k: _unpack(v) for k, v in x["f"].items()})
    if "m" in x:
        return {k: _unpack(v) for k, v in x["m"]}
    return tuple(_unpack(v) for v in x["t"])


def encode(tree) -> bytes:
    """A tree of numpy arrays / registered dataclasses / dicts / tuples / scalars → bytes.
    Raises TypeError for anything else."""
    return msgspec.msgpack.encode(_pack(tree))


def decode(data: bytes):
    """Inverse of `encode` (tuples come back as tuples, lists as tuples)."""
    return _unpack(msgspec.msgpack.decode(data))
