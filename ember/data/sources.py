"""Document sources: each returns a lazy `grain.MapDataset` of one split's documents.

A document is either raw text (`bytes`, tokenized later by the pipeline) or an int32 array
of token ids (synthetic and pre-tokenized sources). Nothing is read at construction: an
element is loaded only when the pipeline indexes it, so building an iterator over a
50 MB corpus costs one directory listing, not one pass over the text.

The eval split is held out by a stable 64-bit hash of each document's *name* (its path
relative to the glob root, plus the record position for multi-record files), so the split
does not depend on the seed, the process count, or on which other files are present.
"""

import glob
import hashlib
import json
import os
import sysconfig
import threading

import grain
import numpy as np

from ember.errors import DataError, one_line
from ember.names import DATA_SOURCES, RECORD_SOURCES

_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)




# --- The eval/train split ---------------------------------------------------------------


def name_hash(name: str) -> int:
  """A 64-bit hash of a document name that is the same in every process and Python run."""
  return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer, vectorised: hashes many record positions without a Python loop."""
  x = np.asarray(x, np.uint64)
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return (x ^ (x >> np.uint64(31))) & _MASK64


def split_indices(hashes: np.ndarray, split: str, eval_fraction: float, key: str) -> np.ndarray:
  """Indices (ascending) of the documents in `split`, chosen by their hashes.

  A document is in eval when its hash, read as a fraction of 2**64, is below
  `eval_fraction`. At least one document lands on each side, so a tiny corpus still
  trains and still evaluates.
  """
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  hashes = np.asarray(hashes, np.uint64)
  if hashes.size < 2:
    raise DataError(f"{key}: found {hashes.size} document(s); need at least 2 (train and eval)")
  u = (hashes >> np.uint64(11)).astype(np.float64) / float(2**53)
  is_eval = u < eval_fraction
  if not is_eval.any():
    is_eval[np.argmin(u)] = True
  if is_eval.all():
    is_eval[np.argmax(u)] = False
  return np.flatnonzero(is_eval if split == "eval" else ~is_eval)


# --- Files --------------------------------------------------------------------------------


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def _stdlib_files() -> list[str]:
  """Every non-empty *.py of this interpreter's standard library, third-party packages pruned."""
  files = []
  for root, dirs, names in os.walk(stdlib_root()):
    dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
    files.extend(os.path.join(root, n) for n in names if n.endswith(".py"))
  return files


def glob_root(pattern: str) -> str:
  """The directory part of `pattern` before its first wildcard: names are relative to it."""
  parts = []
  for part in pattern.split(os.sep):
    if glob.has_magic(part):
      break
    parts.append(part)
  root = os.sep.join(parts)
  if root == pattern:  # No wildcard: a single file (or a directory).
    root = root if os.path.isdir(root) else os.path.dirname(root)
  return root or "."


def list_files(path: str, key: str = "data.path") -> tuple[list[str], str]:
  """Sorted non-empty files matching `path` ("" = stdlib), and the root names are relative to.

  A directory means every file below it. Empty files are skipped: they hold no tokens,
  and a split made only of empty documents would never yield a batch.
  """
  if not path:
    files, root = _stdlib_files(), stdlib_root()
  else:
    path = os.path.expanduser(path)
    pattern = os.path.join(path, "**", "*") if os.path.isdir(path) else path
    files, root = glob.glob(pattern, recursive=True), glob_root(path)
  files = sorted(f for f in files if os.path.isfile(f) and os.path.getsize(f) > 0)
  if not files:
    raise DataError(f"{key}: no non-empty files match {path or stdlib_root()!r}")
  return files, root


FILE_SOURCES = ("text", "array_record", "jsonl", "parquet")  # The sources that read `data.path`'s files.


def files_digest(path: str) -> str:
  """A digest of the files `path` matches (`list_files`): their names, relative to the glob's root, and sizes.
  A saved data position indexes the documents of these files: another set (files added under the glob, one
  rewritten) gives another digest."""
  files, root = list_files(path)
  listing = "\n".join(f"{os.path.relpath(f, root)}:{os.path.getsize(f)}" for f in files)
  return hashlib.blake2b(listing.encode(), digest_size=8).hexdigest()


def _read_bytes(path: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise DataError(f"data.path: cannot read {path} ({one_line(e)})") from e


def text_documents(path: str, split: str, eval_fraction: float) -> grain.MapDataset:
  """One document per file, as raw bytes (the byte tokenizer keeps them exactly)."""
  files, root = list_files(path)
  hashes = [name_hash(os.path.relpath(f, root)) for f in files]
  keep = split_indices(np.array(hashes, np.uint64), split, eval_fraction, f"data.path={path!r}")
  return grain.MapDataset.source([files[i] for i in keep]).map(_read_bytes)


def encode_record(tokens) -> bytes:
  """An ArrayRecord record: a document's token ids as little-endian int32."""
  return np.asarray(tokens, "<i4").tobytes()


def decode_record(record: bytes) -> np.ndarray:
  return np.frombuffer(record, "<i4").astype(np.int32)


def array_record_documents(path: str, split: str, eval_fraction: float, vocab_size: int) -> grain.MapDataset:
  """One document per record; a record is a document's token ids as little-endian int32, each in
  [0, vocab_size): an id outside it (files written with another tokenizer) is a DataError when its record is
  read, where the embedding and the loss would silently read another row."""
  files, root = list_files(path)
  try:
    counts = [len(grain.sources.ArrayRecordDataSource(f)) for f in files]
    source = grain.sources.ArrayRecordDataSource(files)
  except Exception as e:  # array_record raises plain RuntimeError/ValueError on bad files.
    raise DataError(f"data.path: cannot read {path!r} as ArrayRecord files "
                    f"({one_line(e)})") from e
  hashes = np.concatenate([
      mix64(np.arange(n, dtype=np.uint64) ^ np.uint64(name_hash(os.path.relpath(f, root))))
      for f, n in zip(files, counts)
  ])
  keep = split_indices(hashes, split, eval_fraction, f"data.path={path!r}")
  ends = np.cumsum(counts)

  def where(k):
    file = int(np.searchsorted(ends, int(k), side="right"))
    return f"{files[file]}: record {int(k) - (ends[file - 1] if file else 0)}"

  def load(k):
    record = source[int(k)]
    if len(record) % 4:
      raise DataError(f"{where(k)} is {len(record)} bytes, not whole little-endian int32 token ids; write the "
                      "files with python -m ember.data.write_array_record")
    ids = decode_record(record)
    if ids.size and not (0 <= ids.min() and ids.max() < vocab_size):
      bad = ids.min() if ids.min() < 0 else ids.max()
      raise DataError(f"{where(k)} holds token id {bad}, "
                      f"outside model.vocab_size={vocab_size}; write the files with the run's tokenizer "
                      "(python -m ember.data.write_array_record --tokenizer=...) or raise model.vocab_size")
    return ids

  return grain.MapDataset.source(keep).map(load)


# --- Synthetic ----------------------------------------------------------------------------

SYNTHETIC_DOCUMENTS = 1 << 20


def synthetic_document(seed: int, index: int, vocab_size: int) -> np.ndarray:
  """A noisy, learnable token stream: an arithmetic progression or a repeated motif.

  Either pattern is predictable from a few earlier tokens of the same document (a model
  must learn modular addition or copying), and 5% of tokens are replaced by uniform
  noise, so the loss of a small model falls well below log(vocab_size) but not to zero.
  """
  rng = np.random.default_rng((seed, index))
  n = int(rng.integers(32, 513))
  t = np.arange(n)
  if rng.random() < 0.5:
    start, step = rng.integers(0, vocab_size), rng.integers(1, 9)
    tokens = (start + step * t) % vocab_size
  else:
    motif = rng.integers(0, vocab_size, size=int(rng.integers(2, 17)))
    tokens = motif[t % motif.size]
  noise = rng.random(n) < 0.05
  tokens[noise] = rng.integers(0, vocab_size, size=int(noise.sum()))
  return tokens.astype(np.int32)


def synthetic_documents(seed: int, vocab_size: int, split: str,
                        eval_fraction: float) -> grain.MapDataset:
  hashes = mix64(np.arange(SYNTHETIC_DOCUMENTS, dtype=np.uint64))
  keep = split_indices(hashes, split, eval_fraction, "data.source")
  return grain.MapDataset.source(keep).map(
      lambda i: synthetic_document(seed, int(i), vocab_size))


# --- TFDS ---------------------------------------------------------------------------------


def tfds_documents(name: str, data_dir: str, text_key: str, split: str,
                   eval_fraction: float) -> grain.MapDataset:
  """Documents of a TFDS dataset's "train" split, read through its random-access source.

  tensorflow-datasets is an optional extra, imported only here.
  """
  if not name:
    raise DataError("data.tfds_name: must name a TFDS dataset when data.source is 'tfds'")
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise DataError("data.source: 'tfds' needs tensorflow-datasets; install the extra: "
                    "pip install -e '.[tfds]'") from e
  try:
    source = tfds.data_source(name, split="train", data_dir=data_dir or None)
  except Exception as e:  # TFDS raises many types for a missing or unprepared dataset.
    raise DataError(f"data.tfds_name: cannot open {name!r} ({one_line(e)})") from e
  keep = split_indices(mix64(np.arange(len(source), dtype=np.uint64) ^ np.uint64(name_hash(name))),
                       split, eval_fraction, "data.tfds_name")

  def load(k):
    text = source[int(k)][text_key]
    return text.encode() if isinstance(text, str) else bytes(text)

  return grain.MapDataset.source(keep).map(load)


# --- Hugging Face datasets ----------------------------------------------------------------


def hf_documents(dataset: str, config: str, hf_split: str, text_key: str, cache_dir: str, split: str,
                 eval_fraction: float) -> grain.MapDataset:
  """Documents of a Hugging Face dataset's `hf_split`, read by index from the Arrow files `datasets` prepares
  (memory-mapped: the text is read when a document is, not held in memory). Random access, not streaming: each
  data shard takes its own share and shuffles it every epoch, and a run resumes at the exact document, as with
  every other source; the price is the dataset's download and conversion once, into the datasets cache.

  datasets is an optional extra, imported only here."""
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise DataError("data.source: 'hf' needs Hugging Face datasets; install the extra: pip install -e '.[hf]'") from e
  try:
    ds = datasets.load_dataset(os.path.expanduser(dataset), config or None, split=hf_split,
                               cache_dir=cache_dir or None)
  except Exception as e:  # datasets raises many types for a missing dataset, config or split.
    raise DataError(f"data.hf_dataset: cannot load {dataset!r} (config {config or 'default'!r}, split "
                    f"{hf_split!r}): {one_line(e)}") from e
  if text_key not in ds.column_names:
    raise DataError(f"data.text_key: {dataset!r} has no column {text_key!r}; its columns: "
                    f"{', '.join(ds.column_names)}")
  feature = ds.features[text_key]
  if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
    raise DataError(f"data.text_key: column {text_key!r} of {dataset!r} holds {feature}, not text")
  ds = ds.select_columns([text_key])
  keep = split_indices(mix64(np.arange(len(ds), dtype=np.uint64) ^ np.uint64(name_hash(dataset))),
                       split, eval_fraction, "data.hf_dataset")

  def load(k):
    text = ds[int(k)][text_key]  # None (a null record): an empty document, which packs into nothing.
    return b"" if text is None else text.encode()

  return grain.MapDataset.source(keep).map(load)


def open_documents(data_cfg, split: str, *, seed: int, vocab_size: int) -> grain.MapDataset:
  """The documents of `split` for the configured `data.source`."""
  frac = float(data_cfg.eval_fraction)
  source = data_cfg.source
  if source == "synthetic":
    return synthetic_documents(seed, vocab_size, split, frac)
  if source == "text":
    return text_documents(data_cfg.path, split, frac)
  if source == "array_record":
    return array_record_documents(data_cfg.path, split, frac, vocab_size)
  if source == "tfds":
    return tfds_documents(data_cfg.tfds_name, data_cfg.tfds_data_dir, data_cfg.tfds_text_key,
                          split, frac)
  if source == "hf":
    return hf_documents(data_cfg.hf_dataset, data_cfg.hf_config, data_cfg.hf_split, data_cfg.text_key,
                        data_cfg.cache_dir, split, frac)
  if source in RECORD_SOURCES:
    from ember.data import records
    files, root = list_files(data_cfg.path)
    common = dict(split=split, eval_fraction=frac, split_indices=split_indices, name_hash=name_hash, mix64=mix64)
    if source == "jsonl":
      return records.jsonl_documents(files, root, data_cfg.text_key, data_cfg.cache_dir, **common)
    return records.parquet_documents(files, root, data_cfg.text_key, **common)
  raise DataError(f"data.source: unknown source {source!r}; expected one of {', '.join(DATA_SOURCES)}")


_INDEX: dict[str, grain.MapDataset] = {}
_INDEX_LOCK = threading.Lock()


def documents(data_cfg, split: str, *, seed: int, vocab_size: int) -> grain.MapDataset:
  """`open_documents`, built once per process for each source and split: every data shard, and every
  evaluation, slices the same index (listing files, scanning JSONL offsets and reading Parquet footers
  once). A MapDataset is immutable; slicing and shuffling it makes new ones."""
  key = json.dumps({k: getattr(data_cfg, k) for k in ("source", "path", "text_key", "cache_dir", "tfds_name",
                                                  "tfds_data_dir", "tfds_text_key", "hf_dataset", "hf_config",
                                                  "hf_split", "eval_fraction")},
                   sort_keys=True, default=str) + f"|{split}|{seed}|{vocab_size}"
  with _INDEX_LOCK:
    if key not in _INDEX:
      _INDEX[key] = open_documents(data_cfg, split, seed=seed, vocab_size=vocab_size)
    return _INDEX[key]


def shard(ds: grain.MapDataset, process_index: int, process_count: int) -> grain.MapDataset:
  """This process's disjoint share; with fewer documents than processes, shares wrap."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  if len(ds) >= process_count:
    return ds[process_index::process_count]
  i = process_index % len(ds)
  return ds[i:i + 1]

