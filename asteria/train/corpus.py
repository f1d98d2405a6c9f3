"""The embedded default corpus of `asteria.train`: fixed bytes on every Python and platform.

Owns: the snapshot of text that ``--data stdlib`` (the default) trains on, reading it, checking
it, the corpus checksum, and rebuilding the snapshot. Imports nothing but the standard library,
so that any Python can check the bytes: ``python asteria/train/corpus.py`` prints the checksum.

Note [Embedded corpus]
~~~~~~~~~~~~~~~~~~~~~~
The default corpus was the running interpreter's own standard library, which differs between
Python versions (AdamW ended at 1.915 under 3.11 and 2.757 under 3.12: issue 49). It is now a
snapshot of those bytes as CPython 3.11.7 ships them: the first 4,000,000 bytes of its
``Lib/**/*.py`` (no ``site-packages``, ``dist-packages``, ``__pycache__``) in sorted order of
the relative path, 314 files, the last cut at the limit: the former default to the byte under
3.11.7. License: CPython's, the PSF License Agreement version 2 (``embedded/LICENSE-PSF.txt``),
which allows redistribution with that notice. Stored as
``embedded/cpython-3.11.7-stdlib.tar.xz`` (a ustar archive, modes, owners and times zeroed, xz
9e), checked against ``ARCHIVE_SHA256`` before it is read; ``--build`` rebuilds it from a CPython
3.11.7 ``Lib`` and refuses a content checksum other than ``CORPUS_SHA256``: the SHA-256 of the
token stream (little-endian uint32 tokens, ``EOD`` = 256 after each document) before the split,
which ``asteria-train`` reports for every corpus (``data.Corpus.sha256``).
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

EOD = 256
SNAPSHOT_BYTES = 4_000_000
SOURCE = "CPython 3.11.7 standard library (Lib/**/*.py), PSF License 2.0"
ARCHIVE = Path(__file__).resolve().parent / "embedded" / "cpython-3.11.7-stdlib.tar.xz"
LICENSE = ARCHIVE.parent / "LICENSE-PSF.txt"
ARCHIVE_SHA256 = "cb4d2de38e770b74ebe65e20ca54af9f914e628c3914458eeb2796d318d8835e"
CORPUS_SHA256 = "4cdb4dd8d7c639b57a5662f7828d4490df8bad5b638ef0632b1c8d270aa42d75"
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class CorpusError(RuntimeError):
    """The embedded snapshot is missing or not the bytes it should be."""


def documents() -> list[tuple[str, bytes]]:
    """The snapshot's documents, ``(relative path, bytes)`` in order, checked against
    ``ARCHIVE_SHA256`` first."""
    try:
        raw = ARCHIVE.read_bytes()
    except OSError as err:
        raise CorpusError(f"the embedded corpus {ARCHIVE} is missing ({err})") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != ARCHIVE_SHA256:
        raise CorpusError(
            f"the embedded corpus {ARCHIVE} has SHA-256 {digest}, not {ARCHIVE_SHA256}: "
            "reinstall asteria, or rebuild it (python asteria/train/corpus.py --build)"
        )
    out = []
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(raw)), mode="r:") as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member)
            if f is not None:
                out.append((member.name, f.read()))
    return out


def token_bytes(docs: Iterable[bytes], max_bytes: int) -> bytes:
    """The token stream of ``docs`` (at most ``max_bytes`` of their bytes, ``EOD`` after each
    document read) as little-endian uint32s: what the checksum hashes."""
    out = bytearray()
    used = 0
    eod = EOD.to_bytes(4, "little")
    for doc in docs:
        if used >= max_bytes:
            break
        data = doc[: max_bytes - used]
        if not data:
            continue
        used += len(data)
        chunk = bytearray(4 * len(data))
        chunk[0::4] = data  # byte b is the uint32 (b, 0, 0, 0)
        out += chunk
        out += eod
    return bytes(out)


def checksum(docs: Iterable[bytes], max_bytes: int = SNAPSHOT_BYTES) -> str:
    """SHA-256 of ``token_bytes(docs, max_bytes)`` (Note [Embedded corpus])."""
    return hashlib.sha256(token_bytes(docs, max_bytes)).hexdigest()


def stdlib_sources(root: Path) -> list[tuple[str, Path]]:
    """A standard library's ``.py`` files under ``root``, ``(relative path, path)`` in sorted
    order of the relative path (the order the snapshot keeps)."""
    found: list[str] = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(here).relative_to(root)
        found.extend((rel / f).as_posix() for f in files if f.endswith(".py"))
    return [(rel, root / rel) for rel in sorted(found)]


def build(root: Path, out: Path = ARCHIVE) -> str:
    """Write the snapshot of the standard library at ``root`` (CPython 3.11.7's ``Lib``) to
    ``out``; returns the archive's SHA-256. Refuses a snapshot whose content checksum is not
    ``CORPUS_SHA256`` (another Python's library) unless that is still unset."""
    docs: list[tuple[str, bytes]] = []
    used = 0
    for rel, path in stdlib_sources(root):
        if used >= SNAPSHOT_BYTES:
            break
        data = path.read_bytes()[: SNAPSHOT_BYTES - used]
        if data:
            docs.append((rel, data))
            used += len(data)
    got = checksum(d for _, d in docs)
    if CORPUS_SHA256 != "TO-BE-FILLED" and got != CORPUS_SHA256:
        raise CorpusError(f"{root} gives corpus checksum {got}, not {CORPUS_SHA256}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.USTAR_FORMAT) as tar:
        for rel, data in docs:
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    raw = lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(raw)
    print(f"{out}: {len(docs)} files, {used} bytes, corpus checksum {got}")
    return hashlib.sha256(raw).hexdigest()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build"]:
        import sysconfig

        root = Path(argv[1]) if len(argv) > 1 else Path(sysconfig.get_paths()["stdlib"])
        print(f"archive sha256 {build(root)}")
        return 0
    docs = [d for _, d in documents()]
    got = checksum(docs)
    print(
        f"python {sys.version.split()[0]}: {len(docs)} documents, "
        f"{sum(map(len, docs))} bytes, corpus sha256 {got}"
        + ("" if got == CORPUS_SHA256 else f" (EXPECTED {CORPUS_SHA256})")
    )
    return 0 if got == CORPUS_SHA256 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
