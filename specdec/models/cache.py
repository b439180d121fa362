"""The on-disk model cache: where it lives, how writers exclude each other, how results appear.

Several processes (two Ray actors, two pytest workers) may want the same cached model at the
same time. Writers serialise on an exclusive ``fcntl.flock`` per cache entry, build the entry in
a private temporary folder next to its final place, write a *marker* file last, and publish it
with one atomic ``os.rename``. Readers take no lock: a folder whose marker is present and names
the expected source digest is complete, and it never changes afterwards.

Limits: ``flock`` is per host; a cache folder shared over NFS between hosts is not protected.

Layout under :func:`cache_root`::

    locks/<key>.lock      one lock file per entry (empty; kept)
    demo/<role>/          demo HF folders (see specdec.models.demo)
    gguf/<sha256>/        HF folders converted from an arbitrary GGUF file with that digest
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

#: Name of the marker file written last into a complete cache entry.
MARKER = "specdec.json"
#: Version of the cache entry format; entries of another version are rebuilt.
FORMAT_VERSION = 1
_CHUNK = 8 << 20  # bytes read per chunk when hashing or copying (8 MiB)


def cache_root() -> Path:
    """The cache folder: ``$SPECDEC_CACHE`` if set, else ``~/.cache/specdec`` (not created)."""
    return Path(os.environ.get("SPECDEC_CACHE") or "~/.cache/specdec").expanduser()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its parents) for the block.

    Blocks until the lock is free. Released when the block exits or the process dies.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    """Hex sha256 digest of a file's bytes (reads it once, in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_marker(folder: Path) -> dict | None:
    """The marker of a cache entry, or None when the entry is absent, incomplete or unreadable."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT_VERSION else None


def is_complete(folder: Path, source_sha256: str) -> bool:
    """Whether ``folder`` is a complete entry built from a source with digest ``source_sha256``."""
    marker = read_marker(folder)
    return marker is not None and marker.get("source_sha256") == source_sha256


def write_marker(folder: Path, **fields) -> None:
    """Write the marker (``format`` plus ``fields``, JSON) into ``folder``; call it last."""
    data = {"format": FORMAT_VERSION, **fields}
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / MARKER)


def temp_sibling(dest: Path, suffix: str = "") -> Path:
    """A private name next to ``dest`` for building it: ``.<name>.tmp-<pid><suffix>``."""
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}{suffix}")


def remove_stale_temps(dest: Path) -> None:
    """Delete leftovers of crashed builds of ``dest``. Call only while holding dest's lock."""
    for p in dest.parent.glob(f".{dest.name}.tmp-*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def publish(tmp: Path, dest: Path) -> None:
    """Atomically move the finished ``tmp`` (file or folder) to ``dest``, replacing an old one.

    Call only while holding dest's lock. An old folder at ``dest`` (incomplete or stale) is moved
    aside and deleted first, since a folder cannot be renamed onto a non-empty one.
    """
    if dest.is_dir():
        old = temp_sibling(dest, ".old")
        os.rename(dest, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, dest)
