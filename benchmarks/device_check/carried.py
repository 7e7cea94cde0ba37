"""What a run on the lent GPU machine carries, measured: the repository's working tree as the run tool sends it
(tracked files, and untracked ones git does not ignore) plus the ignored paths named in its carry list. The
machine takes at most 64 MiB in all; the check keeps to BUDGET, leaving room for the tree to grow."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

BUDGET = 60 << 20
MAX_CARRIED_PATHS = 8


@dataclass(frozen=True)
class CarriedSize:
    tree: int  # bytes of the working tree's files the run tool sends
    carried: dict[str, int]  # bytes under each carried path

    @property
    def total(self) -> int:
        return self.tree + sum(self.carried.values())

    def describe(self) -> str:
        parts = [f"tree {self.tree / 2**20:.1f} MiB"] + [f"{p} {n / 2**20:.1f} MiB" for p, n in self.carried.items()]
        return f"{self.total / 2**20:.1f} MiB of {BUDGET / 2**20:.0f} ({', '.join(parts)})"


def tree_files(repo: Path) -> list[Path]:
    """The working tree's files the run tool sends: tracked, and untracked but not ignored (those present)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    files = {repo / name.decode() for name in listed if name}
    return sorted(f for f in files if f.is_file() and not f.is_symlink())


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files at or under `path` (symlinks do not travel)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def carried_size(repo: Path, carried: list[Path]) -> CarriedSize:
    """The bytes a run sends: the tree plus each carried path (relative to `repo`, at most MAX_CARRIED_PATHS)."""
    if len(carried) > MAX_CARRIED_PATHS:
        raise ValueError(f"{len(carried)} carried paths: the run tool takes at most {MAX_CARRIED_PATHS}")
    tree = sum(f.stat().st_size for f in tree_files(repo))
    return CarriedSize(tree, {str(p): folder_bytes(repo / p) for p in carried})
