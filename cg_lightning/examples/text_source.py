"""The bytes the GPT example trains on: the running interpreter's standard library, or a UTF-8 text file or folder.

``path=None`` reads the ``.py`` files of the standard library (real text that exists on every machine, no download);
a file is read as raw bytes after a check that it is UTF-8 text; a directory gives every UTF-8 file below it.
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from pathlib import Path

__all__ = ["read_stdlib_bytes", "read_text_bytes"]

# Directory names never descended into when collecting the standard library.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def _limit_reached(total: int, max_bytes: int | None) -> bool:
    return max_bytes is not None and total >= max_bytes


def _join(chunks: list[bytes], max_bytes: int | None) -> bytes:
    data = b"".join(chunks)
    return data if max_bytes is None else data[:max_bytes]


def read_stdlib_bytes(max_bytes: int | None = None) -> bytes:
    """Concatenate the standard library's ``.py`` files as raw bytes.

    Files are taken from ``sysconfig.get_paths()["stdlib"]`` recursively, ordered
    by their relative POSIX path (so the result is deterministic for a given
    Python installation), skipping ``site-packages``/``dist-packages``,
    ``test``/``tests`` and ``__pycache__`` directories.  Reading stops once
    ``max_bytes`` bytes are collected; the result is truncated to ``max_bytes``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {root}")
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                files.append((p.relative_to(root).as_posix(), p))
    files.sort(key=lambda item: item[0])

    chunks: list[bytes] = []
    total = 0
    for _, p in files:
        if _limit_reached(total, max_bytes):
            break
        try:
            data = p.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
    return _join(chunks, max_bytes)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_text_bytes(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """Read a UTF-8 text file, or every UTF-8 file under a directory, as bytes.

    * A file is read (up to ``max_bytes`` bytes) and must be valid UTF-8
      (a multi-byte character cut by the ``max_bytes`` limit is tolerated).
    * A directory is walked recursively; regular files are taken in order of
      their relative POSIX path, files that do not decode as UTF-8 are skipped,
      as are hidden entries (names starting with ``"."``, e.g. ``.git``) and
      ``__pycache__`` directories.  Reading stops once ``max_bytes`` are collected.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not UTF-8 text.
    """
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes)
            truncated = max_bytes is not None and f.read(1) != b""
        try:
            codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
        except UnicodeDecodeError as e:
            raise ValueError(f"{p} is not a UTF-8 text file ({e}); pass a text file, "
                             f"a directory of text files or a uint16 .bin token file") from None
        return data
    if p.is_dir():
        files: list[tuple[str, Path]] = []
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            for name in filenames:
                f = Path(dirpath) / name
                if not name.startswith(".") and f.is_file():
                    files.append((f.relative_to(p).as_posix(), f))
        files.sort(key=lambda item: item[0])
        chunks: list[bytes] = []
        total = 0
        for _, f in files:
            if _limit_reached(total, max_bytes):
                break
            try:
                data = f.read_bytes()
            except OSError:
                continue
            if not _is_utf8(data):
                continue
            chunks.append(data)
            total += len(data)
        return _join(chunks, max_bytes)
    if p.exists():
        raise ValueError(f"data path {str(p)!r} is neither a regular file nor a folder (a device or a pipe); expected "
                         "a UTF-8 text file, a directory of UTF-8 text files, or a .bin file of uint16 token ids")
    raise FileNotFoundError(
        f"data path {str(p)!r} does not exist; expected a UTF-8 text file, a directory "
        f"of UTF-8 text files, or a .bin file of uint16 token ids"
    )
