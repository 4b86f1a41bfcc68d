"""The safetensors file format, read and written with numpy alone (bfloat16 through ml_dtypes).

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
(plus an optional "__metadata__" of strings), then the raw little-endian tensor bytes. Reading maps
the file (`np.memmap`), so slicing a tensor reads only the pages it touches: an importing process
pulls only the shards its devices hold. Written here rather than through the `safetensors` package
so that ember needs neither it nor torch; files are byte-compatible with it.

A directory holds `model.safetensors`, or `model-0000i-of-0000n.safetensors` files and a
`model.safetensors.index.json` whose "weight_map" says which file holds each tensor.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from ember import storage
from ember.errors import CheckpointError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def write_file(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
  """Writes `tensors` (name -> array) to the local file `path` atomically (storage.local_file_replaced)."""
  header, offset = {}, 0
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for name, array in tensors.items():
    size = array.size * array.dtype.itemsize
    header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # Tensor data starts 8-byte aligned.
  with storage.local_file_replaced(path) as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for array in tensors.values():
      f.write(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def write_dir(directory: str, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[str]:
  """`model.safetensors`, or numbered files of at most `max_shard_bytes` each (a tensor larger than the
  limit gets a file of its own) and the index. Returns the files written."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in tensors.items():
    if shards[-1] and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  if len(shards) == 1:
    write_file(os.path.join(directory, SINGLE_FILE), shards[0], {"format": "pt"})
    return [SINGLE_FILE]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  for name, shard in zip(names, shards):
    write_file(os.path.join(directory, name), shard, {"format": "pt"})
  index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
           "weight_map": {t: name for name, shard in zip(names, shards) for t in shard}}
  storage.write_atomic(os.path.join(directory, INDEX_FILE), json.dumps(index, indent=2))
  return names + [INDEX_FILE]


class Reader:
  """The tensors of a directory (single file or index), by name, memory-mapped: `reader[name]` is a
  read-only array whose slices read only what they touch."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
      weight_map = None
    else:
      raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (not a Hugging Face model directory)")
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    self._entries: dict[str, tuple[str, dict, int]] = {}
    for file in files:
      path = os.path.join(directory, file)
      for name, entry, start in _header(path):
        self._entries[name] = (path, entry, start)

  def names(self) -> list[str]:
    return list(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name][1]["shape"])

  def __getitem__(self, name: str) -> np.ndarray:
    path, entry, start = self._entries[name]
    dtype = np.dtype(_DTYPES[entry["dtype"]]).newbyteorder("<")
    shape = tuple(entry["shape"])
    begin, end = entry["data_offsets"]
    if end == begin:
      return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=shape)


def _header(path: str):
  try:
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
  except (OSError, struct.error, ValueError) as e:
    raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
  header.pop("__metadata__", None)
  for name, entry in header.items():
    if entry.get("dtype") not in _DTYPES:
      raise CheckpointError(f"{path}: tensor {name} has dtype {entry.get('dtype')}, which ember does not read")
    yield name, entry, 8 + n
