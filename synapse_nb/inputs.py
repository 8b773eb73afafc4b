"""User inputs and outputs checked before any work: bounded prompt reads, writable output paths,
non-finite logits.

  prompt_byte_limit(tokenizer, n_ctx) -> int   the most prompt bytes n_ctx tokens could ever hold
  read_bounded(f, limit, what) -> bytes        at most limit bytes of a file / stdin, else SynapseError
  check_writable(dest, what)                   SynapseError unless a file can be created beside dest
  check_regular_file(path, what)               SynapseError when path exists and is a device (/dev/zero) or such
  NonFiniteWatch                               notices the first NaN / inf logits row
"""

from __future__ import annotations

import os
import stat
import tempfile

import numpy as np

from .errors import SynapseError

# A generous bound on the prompt bytes one token can stand for: 64 bytes, or the longest token text
# of the vocabulary when it is longer. Every token the tokenizers here produce covers a run of the
# input no longer than its text (SPM: a space becomes the 3-byte U+2581; byte-level BPE: a byte becomes
# a 1- or 2-byte character; byte fallback: one byte), so a prompt of more than n_ctx * bound bytes
# cannot fit in n_ctx tokens. Real prompts average 3-5 bytes per token (English) and rarely 10+
# (long runs of spaces, code); 64 leaves an order of magnitude of headroom over the worst real text
# while keeping the read small: 256 KiB at n_ctx 4096, 8 MiB at 128k.
BYTES_PER_TOKEN = 64


# A vocabulary's longest token raises the bound only up to this many bytes in all (a downloaded
# vocabulary with one 8 MiB token would otherwise let -f /dev/zero read gigabytes before refusing):
# a text-heavy token past 64 bytes is rare, and 256 MiB is 32 times the largest real prompt bound.
PROMPT_BYTES_MAX = 256 << 20


def prompt_byte_limit(tokenizer, n_ctx: int) -> int:
    """The most bytes a prompt that fits in n_ctx tokens can have (see BYTES_PER_TOKEN), >= 64:
    n_ctx * 64, or n_ctx * the longest token when longer, but then at most PROMPT_BYTES_MAX."""
    longest = tokenizer.vocab.max_token_bytes
    n = max(1, n_ctx)
    if longest <= BYTES_PER_TOKEN:
        return n * BYTES_PER_TOKEN
    return max(n * BYTES_PER_TOKEN, min(n * longest, PROMPT_BYTES_MAX))


def read_bounded(f, limit: int, what: str, n_ctx: int) -> bytes:
    """Read at most limit + 1 bytes from the binary file object f (a file, a pipe, /dev/zero).

    Returns the bytes when there are at most `limit`; raises SynapseError (naming `what` and n_ctx)
    when there are more, without reading further. Takes well under a second for any limit
    prompt_byte_limit gives (one read of limit + 1 bytes).
    """
    data = f.read(limit + 1)
    if len(data) > limit:
        raise SynapseError(f"{what}: the prompt is longer than {limit} bytes, more than the context size n_ctx = "
                           f"{n_ctx} tokens can hold; raise -c/--ctx-size or shorten the prompt")
    return data


def check_writable(dest: str, what: str) -> None:
    """SynapseError (naming `what` and the directory) unless a new file can be created in dest's directory.

    Creates and removes an empty temporary file there: permissions, read-only file systems and
    full inode tables show up now, before the model is loaded, not after a long generation.
    """
    d = os.path.dirname(os.path.abspath(dest))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".llama-decode-check-", dir=d)
    except OSError as e:
        raise SynapseError(f"{what} {dest}: cannot write in {d}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)


def check_regular_file(path, what: str, pipes: bool = False, why: str = "") -> None:
    """SynapseError "WHAT PATH: not a regular file" (+ why) when path exists and is not a regular
    file (nor a FIFO, with pipes): a device such as /dev/zero or /dev/full is read without end or
    takes no data, a FIFO opened for reading waits for a writer. A missing path passes (the open
    that follows reports it)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or (pipes and stat.S_ISFIFO(mode))):
        raise SynapseError(f"{what} {path}: not a regular file{why}")


class NonFiniteWatch:
    """Watches logits rows for NaN / inf (from NaN / inf weights, which llama.cpp propagates too).

    check(logits) -> True the first time a float array with a non-finite value is passed, then
    False forever (one warning per run). `bad_rows` counts the rows seen with one.
    """

    def __init__(self):
        self.warned = False
        self.bad_rows = 0

    def check(self, logits: np.ndarray) -> bool:
        a = np.asarray(logits)
        rows = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
        bad = int((~np.isfinite(rows)).any(axis=1).sum())
        self.bad_rows += bad
        if bad and not self.warned:
            self.warned = True
            return True
        return False


class NewFile:
    """An output file (--logits-out, a .kld base) written whole before it gets its final name, never
    replacing an existing file, and leaving nothing behind when the run is killed.

    NewFile(dest, what): the data goes to an unnamed file in dest's directory (Linux O_TMPFILE: the
    kernel reclaims it when the process dies, even by SIGKILL); commit() links it as dest (failing
    if dest appeared meanwhile). Where O_TMPFILE is missing (another OS, some file systems) it is a
    named file DEST.tmpPID, linked then removed; such files left by killed runs (their PID no
    longer running) are removed by the next NewFile of the same dest. f: the binary file object;
    write(data); commit(); abort() (idempotent). OSError is raised as SynapseError naming `what`.
    """

    def __init__(self, dest, what: str):
        self.dest, self.what = str(dest), what
        d = os.path.dirname(os.path.abspath(self.dest))
        self.tmp = None
        fd = None
        if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
            try:
                fd = os.open(d, os.O_TMPFILE | os.O_RDWR, 0o644)
            except OSError:
                fd = None
        try:
            if fd is None:
                remove_stale_temps(self.dest)
                self.tmp = f"{self.dest}.tmp{os.getpid()}"
                fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise SynapseError(f"{what} {self.dest}: cannot write {self.tmp}: {e.strerror or e}") from None
        self.f = os.fdopen(fd, "wb")

    def write(self, data) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            self.abort()
            raise SynapseError(f"{self.what} {self.dest}: {e.strerror or e}") from None

    def commit(self) -> None:
        import errno

        try:
            self.f.flush()
            if self.tmp is None and not self._link_unnamed():
                self._to_named()  # the unnamed file cannot be linked here: copied to a named one
            if self.tmp is not None:
                self.f.close()
                try:
                    os.link(self.tmp, self.dest)  # fails if dest appeared meanwhile, unlike os.replace
                except OSError as e:
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP) or os.path.lexists(self.dest):
                        raise
                    os.replace(self.tmp, self.dest)  # a file system without hard links
        except OSError as e:
            raise SynapseError(f"{self.what} {self.dest}: {e.strerror or e}") from None
        finally:
            self.abort()

    def _link_unnamed(self) -> bool:
        """Link the unnamed file as dest: linkat through /proc/self/fd, else linkat(AT_EMPTY_PATH).
        False when neither is allowed (EXDEV in some containers, EPERM / ENOENT without the
        capability); OSError (EEXIST: dest appeared meanwhile) otherwise."""
        import ctypes
        import errno

        try:
            os.link(f"/proc/self/fd/{self.f.fileno()}", self.dest, follow_symlinks=True)
            return True
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EACCES, errno.EINVAL):
                raise
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.linkat(self.f.fileno(), b"", -100, os.fsencode(self.dest), 0x1000) == 0:  # AT_FDCWD, AT_EMPTY_PATH
                return True
            err = ctypes.get_errno()
        except (OSError, AttributeError):
            return False
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), self.dest)
        return False

    def _to_named(self) -> None:
        import shutil

        remove_stale_temps(self.dest)
        self.tmp = f"{self.dest}.tmp{os.getpid()}"
        with open(self.tmp, "xb") as named:
            self.f.seek(0)
            with os.fdopen(os.dup(self.f.fileno()), "rb") as src:
                src.seek(0)
                shutil.copyfileobj(src, named, 1 << 20)
        self.f.close()

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        if self.tmp is not None and os.path.exists(self.tmp):
            os.unlink(self.tmp)


def remove_stale_temps(dest) -> list[str]:
    """Remove DEST.tmpPID and DEST.tmpPID.npy files (NewFile's named temporaries, and the names of
    earlier versions) whose PID is not a running process: left by a killed run. Returns their paths."""
    import re

    d = os.path.dirname(os.path.abspath(dest))
    base = os.path.basename(dest)
    pat = re.compile(re.escape(base) + r"\.tmp([0-9]{1,10})(\.npy)?")
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in names:
        m = pat.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_running(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(d, name))
            removed.append(os.path.join(d, name))
        except OSError:
            pass
    return removed


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # someone else's process (or unknowable): its file is left alone
    return True
