"""Record files: JSON Lines (plain, .gz, .zst) and Parquet, read lazily, one document per record.

  data.source=jsonl    data.path=glob of *.jsonl[.gz|.zst]   data.text_key=the field holding the text
  data.source=parquet  data.path=glob of *.parquet          data.text_key=the text column

Lazily:
  * JSONL: each file is scanned once for its line offsets (in 1 MiB reads); a document is one seek
    and one line. A compressed file is first decompressed, streaming, into `data.cache_dir` (once:
    the cache file is named by the source's path, size and modification time), then read the same
    way. Memory holds offsets, never a file.
  * Parquet: only the footers are read up front (row counts per row group); an element of the source
    is a whole row group (its text column, read at once): the split into train/eval, the data shards
    and the shuffle work at row-group granularity, so write files with many row groups (pyarrow's
    `row_group_size`, e.g. 1,000 rows) and more row groups than data shards.
Documents are indexed across all files, split into train/eval by a hash of (file, record), and
sharded and shuffled by the pipeline like any source.

Bad data, by rule:
  * empty lines are not records;
  * skipped and counted (`skipped_records()`, logged by the trainer, summed over processes, as
    `data_skipped_records`: records *read*, so prefetching, later epochs and evaluations count again):
    a line that is not UTF-8 or not JSON (whitespace-only lines too), a record without the text field,
    a text that is not a string, a Parquet text that is null;
  * one-line error naming the key and the file: no string text field among a source's first lines
    (a wrong `data.text_key`, or a file of another format), a Parquet text column of another type;
  * one-line error naming the file (exit 2): a file that cannot be opened, a truncated or otherwise
    unreadable Parquet file (its footer is read up front), a `text_key` that is not a column of a
    Parquet file; an empty file is skipped like any empty file (a glob matching none is an error).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import tempfile
import threading

import grain
import numpy as np

from ember.errors import DataError, one_line

_COMPRESSED = (".gz", ".zst")
_lock = threading.Lock()
_skipped = {"records": 0}


def skipped_records() -> int:
  """Records skipped as bad data by this process so far (see the module doc)."""
  return _skipped["records"]


def _skip() -> bytes:
  with _lock:
    _skipped["records"] += 1
  return b""  # An empty document: the packer drops documents under 2 tokens.


# --- JSON Lines --------------------------------------------------------------------------------------


def _decompressed(path: str, cache_dir: str) -> str:
  """The plain-text copy of a compressed JSONL file (made once, atomically, streaming)."""
  st = os.stat(path)
  key = hashlib.blake2b(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=12).hexdigest()
  directory = os.path.expanduser(cache_dir) or os.path.join(tempfile.gettempdir(), f"ember_jsonl_cache_{os.getuid()}")
  target = os.path.join(directory, f"{key}.jsonl")
  if os.path.exists(target):
    return target
  try:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{key}.lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # The processes of a host decompress a file once, not each.
      if not os.path.exists(target):
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".part")
        try:
          with os.fdopen(fd, "wb") as out, _open_compressed(path) as src:
            shutil.copyfileobj(src, out, 1 << 20)
          os.chmod(tmp, 0o644)
          os.replace(tmp, target)
        finally:
          if os.path.exists(tmp):
            os.unlink(tmp)
  except Exception as e:  # An unwritable cache, a corrupt archive, a full disk.
    raise DataError(f"data.cache_dir: cannot decompress {path} into {directory} ({one_line(e)})") from None
  return target


def _open_compressed(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  import zstandard  # An ember dependency; imported where it is needed.
  return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)


def line_offsets(path: str) -> np.ndarray:
  """Start offsets of the non-blank lines of a file (scanned in 1 MiB reads; offsets only in memory)."""
  after_newlines, size = [np.zeros(1, np.int64)], 0
  try:
    with open(path, "rb") as f:
      while block := f.read(1 << 20):
        after_newlines.append(np.flatnonzero(np.frombuffer(block, np.uint8) == 10).astype(np.int64) + size + 1)
        size += len(block)
  except OSError as e:
    raise DataError(f"data.path: cannot read {path} ({one_line(e)})") from e
  starts = np.concatenate(after_newlines)
  ends = np.append(starts[1:], size)
  ends_in_newline = np.arange(len(starts)) < len(starts) - 1
  return starts[(ends - starts - ends_in_newline) > 0]


def _read_line(path: str, offset: int) -> bytes:
  try:
    with open(path, "rb") as f:
      f.seek(offset)
      return f.readline()
  except OSError as e:  # The file (or its decompressed copy) went away during the run.
    raise DataError(f"data.path: cannot read {path} ({one_line(e)})") from None


def _jsonl_text(line: bytes, text_key: str) -> bytes:
  try:
    record = json.loads(line.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    return _skip()
  text = record.get(text_key) if isinstance(record, dict) else None
  return text.encode("utf-8") if isinstance(text, str) else _skip()


def _check_some_records(files, plain, offsets, text_key: str, sample: int = 256) -> None:
  """A source none of whose first `sample` lines holds a string `text_key` is a wrong key or a wrong file
  (a compression this reader does not know), not bad data: an error naming both, instead of a pipeline
  that skips every record forever."""
  seen = 0
  for f, p, o in zip(files, plain, offsets):
    for offset in o[:sample - seen]:
      seen += 1
      try:
        record = json.loads(_read_line(p, int(offset)).decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError):
        continue
      if isinstance(record, dict) and isinstance(record.get(text_key), str):
        return
    if seen >= sample:
      break
  raise DataError(f"data.text_key: none of the first {seen} lines of {files[0]} (and the files after it) is a JSON "
                  f"record with a string {text_key!r} field (is it the field, and plain, .gz or .zst JSON Lines?)")


def jsonl_documents(files: list[str], root: str, text_key: str, cache_dir: str, split: str, eval_fraction: float,
                    split_indices, name_hash, mix64) -> grain.MapDataset:
  plain = [_decompressed(f, cache_dir) if f.endswith(_COMPRESSED) else f for f in files]
  offsets = [line_offsets(p) for p in plain]
  counts = np.array([len(o) for o in offsets], np.int64)
  if not counts.sum():
    raise DataError(f"data.path: no JSON lines in {len(files)} file(s) under {root!r}")
  _check_some_records(files, plain, offsets, text_key)
  hashes = np.concatenate([mix64(np.arange(n, dtype=np.uint64) ^ np.uint64(name_hash(os.path.relpath(f, root))))
                           for f, n in zip(files, counts)])
  keep = split_indices(hashes, split, eval_fraction, "data.path")
  ends = np.cumsum(counts)

  def load(k):
    i = int(np.searchsorted(ends, k, side="right"))
    line = _read_line(plain[i], int(offsets[i][k - (ends[i] - counts[i])]))
    return _jsonl_text(line, text_key)

  return grain.MapDataset.source(keep).map(load)


# --- Parquet -------------------------------------------------------------------------------------------


def _parquet_file(path: str):
  import pyarrow.parquet as pq  # An ember dependency; imported where it is needed.
  try:
    return pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises ArrowInvalid / OSError for truncated or foreign files.
    raise DataError(f"data.path: cannot read {path} as Parquet ({one_line(e)})") from None


def parquet_documents(files: list[str], root: str, text_key: str, split: str, eval_fraction: float,
                      split_indices, name_hash, mix64) -> grain.MapDataset:
  """One element per row group: the list of its documents (read together, so a shuffled pipeline
  still reads each row group once); the pipeline flattens them. Footers are read here."""
  groups = []
  for f in files:
    pf = _parquet_file(f)
    if text_key not in pf.schema_arrow.names:
      raise DataError(f"data.text_key: {text_key!r} is not a column of {f} (columns: "
                      f"{', '.join(pf.schema_arrow.names)})")
    import pyarrow as pa
    kind = pf.schema_arrow.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
      raise DataError(f"data.text_key: column {text_key!r} of {f} holds {kind}, not strings")
    groups += [(f, g) for g in range(pf.metadata.num_row_groups) if pf.metadata.row_group(g).num_rows]
  if not groups:
    raise DataError(f"data.path: no Parquet rows in {len(files)} file(s) under {root!r}")
  hashes = mix64(np.array([name_hash(f"{os.path.relpath(f, root)}:{g}") for f, g in groups], np.uint64))
  keep = split_indices(hashes, split, eval_fraction, "data.path")

  def load(k):
    path, group = groups[int(k)]
    try:
      column = _parquet_file(path).read_row_group(group, columns=[text_key]).column(0).to_pylist()
    except DataError:
      raise
    except Exception as e:
      raise DataError(f"data.path: cannot read row group {group} of {path} ({one_line(e)})") from None
    return [t.encode("utf-8") if isinstance(t, str) else _skip() for t in column]

  return grain.MapDataset.source(keep).map(load)
