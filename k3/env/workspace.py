"""A sandbox's files: a read-only base shared by a sandbox and its forks, plus a private layer of changes.

With overlayfs (root, or a kernel that mounts it here) the workspace is ``lowerdir=base, upperdir=upper``:
- create writes the task's files into ``base`` once; every fork of the family shares it read-only;
- a write copies the file up into this sandbox's ``upper`` (copy-on-write at file granularity);
- fork copies ``upper`` only (the changes since the base), so its cost is O(changed bytes), not O(workspace);
- snapshot copies ``upper`` too, and is incremental: a file unchanged since the previous snapshot (same size,
  mtime and mode, and older than the previous snapshot) is hard-linked to that snapshot's copy instead of copied.
  Snapshots are immutable, so the links are safe; ``upper`` itself is never linked (overlay writes it in place);
- a snapshot is a chain of such layers over the base (its own copy of ``upper``, then the layers it was taken
  over), and restore mounts that chain as the lower layers under a fresh empty ``upper``: O(1), no bytes copied
  (overlayfs stacks up to 500 lower layers; whiteouts in a layer hide the files of the layers below).
Without overlayfs (no mount rights) ``upper`` is the whole workspace and the same code runs: fork and the first
snapshot then copy everything. No filesystem here does reflinks (ext4), so a copy is a byte copy.
Whiteouts (deleted base files: character devices 0/0) and opaque directories (an xattr) are copied as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import stat
import threading
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
MNT_DETACH = 2


def _mount_overlay(lower: Path | str, upper: Path, work: Path, merged: Path) -> None:
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if _libc.mount(b"overlay", str(merged).encode(), b"overlay", 0, opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount overlay on {merged}: {os.strerror(e)}")


def _umount(path: Path) -> None:
    if _libc.umount2(str(path).encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {path}: {os.strerror(e)}")


_PROBED: dict[Path, bool] = {}


def overlay_works(root: Path) -> bool:
    """Try one overlay mount under ``root`` (needs CAP_SYS_ADMIN in the mount's user namespace); cached."""
    if root in _PROBED:
        return _PROBED[root]
    _PROBED[root] = _probe(root)
    return _PROBED[root]


def _probe(root: Path) -> bool:
    probe = root / f".probe-{os.getpid()}"
    dirs = [probe / d for d in ("l", "u", "w", "m")]
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        _mount_overlay(*dirs)
        _umount(dirs[3])
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _copy_xattrs(src: str, dst: str) -> None:
    for name in os.listxattr(src, follow_symlinks=False):
        if name.startswith("trusted.overlay."):
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)


def copy_tree(src: Path, dst: Path, previous: Path | None = None, manifest: dict | None = None,
              since: float = 0.0) -> dict:
    """Copy an upper layer; hard-link regular files unchanged since ``previous`` (see the module docstring).

    Returns the new manifest {relative path: (size, mtime_ns, mode)}. ``since`` is the previous snapshot's time:
    files modified after it minus a 50 ms margin (timestamps tick in jiffies) are always copied.
    """
    manifest = manifest or {}
    out = {}
    dst.mkdir(parents=True, exist_ok=True)
    _copy_xattrs(str(src), str(dst))
    margin_ns = int((since - 0.05) * 1e9)
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = os.path.relpath(dirpath, src)
        target_dir = dst if rel_dir == "." else dst / rel_dir
        for d in list(dirnames):
            s, t = os.path.join(dirpath, d), target_dir / d
            if os.path.islink(s):
                os.symlink(os.readlink(s), t)
                dirnames.remove(d)
                continue
            t.mkdir()
            shutil.copystat(s, t)
            _copy_xattrs(s, str(t))
        for f in filenames:
            s, t = os.path.join(dirpath, f), target_dir / f
            st = os.lstat(s)
            rel = os.path.normpath(os.path.join(rel_dir, f))
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
            elif stat.S_ISCHR(st.st_mode):  # an overlay whiteout
                os.mknod(t, st.st_mode, st.st_rdev)
            else:
                key = (st.st_size, st.st_mtime_ns, st.st_mode)
                if previous is not None and manifest.get(rel) == key and st.st_mtime_ns < margin_ns:
                    os.link(previous / rel, t)
                else:
                    shutil.copy2(s, t)
                    _copy_xattrs(s, str(t))
                out[rel] = key
    return out


class Workspace:
    """The directories of one sandbox under ``root``: ``family/base`` shared, ``family/<name>/{upper,work,merged}``."""

    def __init__(self, family: Path, name: str, overlay: bool, lowers: tuple[Path, ...] = ()):
        self.family, self.name, self.overlay = family, name, overlay
        self.lowers = lowers  # snapshot layers between upper and base, top first (set by restore)
        self.base = family / "base"
        self.dir = family / name
        self.upper, self.work, self.merged = self.dir / "upper", self.dir / "work", self.dir / "merged"
        self.mounted = False

    @property
    def path(self) -> Path:
        """The host path the sandbox sees as its workspace."""
        return self.merged if self.overlay else self.upper

    def create(self, files: dict[str, bytes | str] | None) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        for rel, data in (files or {}).items():
            p = self.base / rel if self.overlay else self.upper / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data.encode() if isinstance(data, str) else data)
        self.upper.mkdir(parents=True, exist_ok=True)
        self.mount()

    def mount(self) -> None:
        if not self.overlay or self.mounted:
            return
        for d in (self.upper, self.work, self.merged):
            d.mkdir(parents=True, exist_ok=True)
        _mount_overlay(":".join(map(str, (*self.lowers, self.base))), self.upper, self.work, self.merged)
        self.mounted = True

    def unmount(self) -> None:
        if self.mounted:
            _umount(self.merged)
            self.mounted = False

    def fork_into(self, name: str) -> Workspace:
        """A sibling sharing the base, with a copy of this one's changes. Call with the sandbox frozen."""
        child = Workspace(self.family, name, self.overlay, self.lowers)
        copy_tree(self.upper, child.upper)
        child.mount()
        return child

    def restore(self, layers: tuple[Path, ...]) -> None:
        """The snapshot's layers become the lowers under an empty upper (overlay), or are copied (no overlay:
        then a snapshot is one full layer). Call with no process left in the sandbox."""
        self.unmount()
        trash = self.dir / f"trash-{os.urandom(4).hex()}"  # renamed now (O(1)), deleted off the caller's path
        trash.mkdir()
        for d in (self.upper, self.work):
            if d.exists():
                d.rename(trash / d.name)
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()
        if self.overlay:
            self.lowers = tuple(layers)
            self.upper.mkdir()
        else:
            copy_tree(layers[0], self.upper)
        self.mount()

    def remove(self) -> None:
        """Unmount and delete this sandbox's directories, and the family's base once no member is left."""
        self.unmount()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            members = [p for p in self.family.iterdir() if p.name not in ("base", "snapshots")]
        except FileNotFoundError:
            return
        if not members:
            shutil.rmtree(self.family, ignore_errors=True)

