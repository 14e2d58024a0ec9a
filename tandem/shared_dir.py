"""The cell's shared directory: created private, and refused when others could tamper with it.

The directory holds the segment (images of every tenant) and the workers' sockets (the
internal Step API, unauthenticated). Whoever can write to it could plant a socket or a
segment file the scheduler or a worker would then trust, and whoever can list and open
files in it could read every image. So the scheduler checks it at start: it must be owned
by the scheduler's user and writable by nobody else (by its group too only with
``--shm-group-mode``, where workers run as another user of that group).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeSharedDir(PermissionError):
    """The shared directory is owned by another user or writable by others."""


def prepare_shared_dir(path: Path, group_mode: bool = False) -> None:
    """Create ``path`` (0700, or 0770 in group mode) if missing, then check it."""
    path.mkdir(mode=0o770 if group_mode else 0o700, parents=True, exist_ok=True)
    check_shared_dir(path, group_mode)


def check_shared_dir(path: Path, group_mode: bool = False) -> None:
    """UnsafeSharedDir unless ``path`` is a directory this user owns that no one else (no
    other group member, unless ``group_mode``) may write to."""
    st = os.stat(path)  # follows a symlink: the directory actually used is checked
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSharedDir(f"shared directory {path} is not a directory")
    problems = []
    if st.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by this process (uid "
                        f"{os.geteuid()})")
    if st.st_mode & stat.S_IWOTH:
        problems.append("anyone may write to it (mode o+w)")
    if st.st_mode & stat.S_IWGRP and not group_mode:
        problems.append("its group may write to it (mode g+w) and --shm-group-mode is off")
    if problems:
        raise UnsafeSharedDir(
            f"refusing the shared directory {path} (mode {stat.S_IMODE(st.st_mode):04o}): "
            + "; ".join(problems) + ". Use a directory of its own, created by this user with "
            "mode 0700 (e.g. `install -d -m 0700 DIR`), or let `tandem` create it.")
