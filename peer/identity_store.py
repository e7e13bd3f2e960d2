"""The volunteer's key file: created on first start, then loaded and checked every start.

The file holds the libp2p private-key protobuf of an Ed25519 key (``protocol.identity``), so
the same path is handed to hivemind as ``identity_path`` and the daemon's peer ID is the
signing key's. It lives in the user's data dir (``platformdirs``), e.g.
``~/.local/share/swarmstream/identity.key`` on Linux, with mode 0600 in a 0700 directory.

A key file that other users can read, that belongs to someone else, or that does not parse
is refused with one line that says what to do; it is never silently replaced, because a new
key is a new peer ID and the volunteer's credit is tied to the old one.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from peer import paths
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, InvalidKey

logger = logging.getLogger(__name__)

APP_NAME = "swarmstream"
IDENTITY_FILENAME = "identity.key"
_MAX_KEY_FILE_BYTES = 4096  # a key file is 68 bytes; never read a huge file by mistake


class IdentityFileError(RemoteProtocolError):
    """The key file is unusable (loose permissions, another owner, corrupt, unreadable)."""


def default_identity_path() -> Path:
    """Where the volunteer's key lives unless ``--identity`` says otherwise."""
    return paths.identity_path()


def load_or_create_identity(path: str | os.PathLike[str] | None = None) -> Identity:
    """Load the key at ``path`` (default: ``default_identity_path()``), creating it on first
    start. Raises IdentityFileError with a one-line reason and fix."""
    path = Path(path) if path is not None else default_identity_path()
    try:
        return load_identity(path)
    except FileNotFoundError:
        return create_identity(path)


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """Load an existing key file; FileNotFoundError if there is none."""
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the start.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise IdentityFileError(f"cannot read identity file {path}: {e.strerror}; check its permissions") from None
    if stat.S_ISDIR(os.fstat(fd).st_mode):  # fdopen refuses a folder with a bare errno
        os.close(fd)
        raise IdentityFileError(f"identity path {path} is not a regular file (a folder); point --identity at the key file")
    with os.fdopen(fd, "rb") as f:
        _check_private(path, os.fstat(f.fileno()))  # fstat: the file we read, not a swapped one
        data = f.read(_MAX_KEY_FILE_BYTES + 1)
    try:
        identity = Identity.from_libp2p(data)
    except InvalidKey as e:
        raise IdentityFileError(
            f"identity file {path} is not a usable swarmstream key ({e}); restore it from a backup, or move it "
            "away to create a new identity (your peer ID and credit start over)") from None
    logger.debug("identity loaded path=%s peer_id=%s", path, identity.peer_id)
    return identity


def create_identity(path: str | os.PathLike[str]) -> Identity:
    """Create a new key file at ``path`` (and its directory, mode 0700). Never overwrites:
    if another process created the file first, that key is loaded instead."""
    path = Path(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise IdentityFileError(f"cannot create the directory {path.parent}: {e.strerror}; "
                                "create it or pass --identity with a writable path") from None
    identity = Identity.generate()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_libp2p())
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path)
    except FileExistsError:
        return load_identity(path)
    except OSError as e:
        raise IdentityFileError(f"cannot write identity file {path}: {e.strerror}; "
                                "pass --identity with a writable path") from None
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    logger.info("identity created path=%s peer_id=%s", path, identity.peer_id)
    return identity


def _publish(tmp: Path, path: Path) -> None:
    # link() fails if the target exists, so two first starts racing cannot replace each
    # other's key; the loser loads the winner's. Filesystems without hard links get a rename.
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(tmp, path)


def _check_private(path: Path, st: os.stat_result) -> None:
    if os.name != "posix":
        return  # no POSIX modes to check; WSL2 is the supported route on Windows
    if not stat.S_ISREG(st.st_mode):
        raise IdentityFileError(f"identity path {path} is not a regular file; point --identity at the key file")
    if st.st_uid != os.getuid():
        raise IdentityFileError(f"identity file {path} belongs to another user (uid {st.st_uid}); "
                                "use your own key file, or pass --identity")
    if st.st_mode & 0o077:
        raise IdentityFileError(f"identity file {path} is readable by other users "
                                f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}` and start again")
    if st.st_size > _MAX_KEY_FILE_BYTES:
        raise IdentityFileError(f"identity file {path} is {st.st_size} bytes, not a key; "
                                "check that --identity points at the key file")


def _fsync_dir(directory: Path) -> None:
    # Make the new name durable too; not all platforms can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
