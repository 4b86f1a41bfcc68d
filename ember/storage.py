"""Where a run's files live: a local directory or a Google Cloud Storage bucket (`gs://bucket/path`).

A multi-host job needs one place every process reaches. A shared POSIX filesystem is one; a bucket is the other,
with nothing to mount. Orbax writes and reads checkpoints in either (TensorStore's own GCS driver); the run's small
files (metrics.jsonl, the data position, the fingerprints, the W&B run id) go through the functions here, which
keep one promise on both: a reader sees an old file or a new one, never a torn one.
  - local: a new file is written beside its target, fsync'd and renamed over it; a record is appended whole and
    fsync'd (a crash leaves at most a torn last line, which readers skip);
  - gs://: an object write is atomic (the object is replaced whole when the upload completes), so appending a record
    rewrites the object: metrics.jsonl costs its size per logged step, a few MB over a long run.

Paths in gs:// go through etils.epath and gcsfs (`pip install -e ".[gcs]"`); credentials are Google's usual ones
(`gcloud auth application-default login`, a service account, or a VM's). S3 is not offered: Orbax 0.12 builds
TensorStore paths for local files and gs:// only.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import os
import secrets
import tempfile

REMOTE_SCHEMES = ("gs://",)
UNSUPPORTED_SCHEMES = ("s3://", "http://", "https://", "hdfs://")


def is_remote(path: str) -> bool:
  return str(path).startswith(REMOTE_SCHEMES)


def bucket(url: str) -> str:
  """`gs://BUCKET/a/b` -> `gs://BUCKET`."""
  return "gs://" + url.removeprefix("gs://").split("/")[0]


def scheme_problem(path: str) -> str | None:
  """Why `path` cannot hold a run (a URL scheme ember does not write to), or None."""
  path = str(path)
  for scheme in UNSUPPORTED_SCHEMES:
    if path.startswith(scheme):
      return (f"{path}: {scheme} is not supported (Orbax writes checkpoints to local paths and gs:// only); "
              "use gs:// or a filesystem every host mounts")
  if is_remote(path) and bucket(path) == "gs://":
    return f"{path}: names no bucket"
  return None


def _epath(path: str):
  try:
    import gcsfs  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ImportError(f"{path}: gs:// paths need gcsfs: pip install -e \".[gcs]\"") from None
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(path)


def absolute(path: str) -> str:
  """A local path made absolute (~ expanded); a URL (any `scheme://`, supported or not: validation names one that
  is not) as given, less a trailing slash."""
  path = str(path)
  return path.rstrip("/") if "://" in path else os.path.abspath(os.path.expanduser(path))


def join(path: str, *parts: str) -> str:
  return os.path.join(str(path), *parts)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def makedirs(path: str) -> None:
  """A local directory and its parents; nothing for a bucket (its "directories" are name prefixes)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def read_text(path: str) -> str:
  if is_remote(path):
    return _epath(path).read_text()
  with open(path) as f:
    return f.read()


def write_atomic(path: str, text: str) -> None:
  """`path` holds `text`, replacing what it held; never half of either."""
  write_bytes(path, text.encode())


def kept_id(path: str, nbytes: int) -> str:
  """The id kept at `path`: made (random, hex, written atomically) by the first caller, read by every later one."""
  if not exists(path):
    write_atomic(path, secrets.token_hex(nbytes))
  return read_text(path).strip()


def write_bytes(path: str, data: bytes) -> None:
  """`path` holds `data` (a bucket's object replaced whole; a local file replaced by rename, from a file named for
  this writer alone: processes that write the same path at once never share a half-written one)."""
  if is_remote(path):
    _epath(path).write_bytes(data)
    return
  with local_file_replaced(path) as f:
    f.write(data)


@contextlib.contextmanager
def local_file_replaced(path: str):
  """A binary file to write that becomes the local file `path` whole when the block ends: written under a name of its
  own beside it (created new, with the permissions the umask gives any file; writers of one path at once never share
  it), on disk, then renamed over `path`. An error in the block leaves `path` as it was and removes the partial file;
  a kill leaves it as it was and the partial file beside it."""
  tmp = f"{path}.{secrets.token_hex(6)}.tmp"
  try:
    with open(tmp, "xb") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def append_line(path: str, line: str) -> None:
  """One complete line added to `path` (created if missing), on disk when this returns."""
  if is_remote(path):
    try:
      old = read_text(path)  # One request, not an existence check and then a read.
    except FileNotFoundError:
      old = ""
    write_atomic(path, old + line + "\n")
    return
  with open(path, "a") as f:
    f.write(line + "\n")
    f.flush()
    os.fsync(f.fileno())


def glob(directory: str, pattern: str) -> list[str]:
  """The paths in `directory` whose names match `pattern`, sorted."""
  if is_remote(directory):
    return sorted(str(p) for p in _epath(directory).glob(pattern))
  return sorted(_glob.glob(os.path.join(directory, pattern)))


class Mirror:
  """A local directory whose files are copied whole to `remote` on `sync`, for writers that only write local files
  (TensorBoard's event writer, the profiler). For a local `remote` the directory is `remote` itself."""

  def __init__(self, remote: str):
    self.remote = remote
    self._local = None if is_remote(remote) else remote
    self._sent: dict[str, int] = {}

  @property
  def local(self) -> str:
    if self._local is None:
      self._local = tempfile.mkdtemp(prefix="ember-")
    return self._local

  def sync(self) -> None:
    """Copies each file whose size changed since the last sync."""
    if self._local is None or self._local == self.remote:
      return
    for root, _, files in os.walk(self.local):
      for name in files:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        if self._sent.get(path) != size:
          with open(path, "rb") as f:
            write_bytes(join(self.remote, os.path.relpath(path, self.local)), f.read())
          self._sent[path] = size


def rename(src: str, dst: str) -> None:
  """A file or directory renamed (in a bucket: copied and deleted, object by object)."""
  if is_remote(src):
    _epath(src).rename(dst)
  else:
    os.rename(src, dst)
