"""Run directories are claimed, never clobbered. A default directory gets a name no other run has (a numbered
suffix when two runs start in the same second: `mkdir` either creates it or fails, so two processes can never
both get it); an explicit --out that already holds something is refused unless the user says --resume (carry
on with it) or --overwrite (replace it); and a command that fails before it measured anything takes back the
directory it made, so no empty run directories pile up."""

from __future__ import annotations

import datetime as _dt
import shutil
from pathlib import Path

from kvbench.errors import KvbenchError

MAX_SUFFIX = 10_000
MANIFEST = "sweep.json"  # what makes a folder a sweep (kvbench.run.sweeps writes it)


def stamp() -> str:
    """UTC time to the second, the start of every default run name."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")


def fresh_dir(base: Path) -> Path:
    """Create and return `base`, or `base-2`, `base-3`, … when taken: the first name this process made itself."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, MAX_SUFFIX):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise KvbenchError(f"{base}: {MAX_SUFFIX} runs of this name already exist; give --out DIR")


def check_new_file(path: Path | str, overwrite: bool, what: str) -> None:
    """Refuse to replace an existing result file unless --overwrite (checked before the work that writes it)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise KvbenchError(f"{path}: already holds a {what}; choose another path or replace it with --overwrite")


def _holds_something(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _empty(path: Path) -> None:
    for child in path.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


class RunDir:
    """The directory a command writes its results to. `state`: "new" (this command made it), "empty" (it was
    empty, or emptied by --overwrite) or "resumed" (it holds an earlier run's results). `discard()` takes back
    what a command that failed before measuring anything wrote: a new directory goes, an empty one is emptied
    again, a resumed one is never touched."""

    def __init__(self, path: Path, state: str):
        self.path, self.state = path, state

    @classmethod
    def claim(
        cls,
        out: Path | str | None,
        default: Path,
        *,
        resume: bool = False,
        overwrite: bool = False,
        what: str = "run",
        resumable: bool = True,
    ) -> RunDir:
        """The run directory for `--out OUT` (None: a fresh one named after `default`). Call it only after every
        option was checked: --overwrite empties OUT here. `resumable`: the command has --resume (for the hint)."""
        if resume and overwrite:
            raise KvbenchError("--resume continues a run and --overwrite replaces it: give one of them")
        if out is None:
            if resume:
                raise KvbenchError(f"--resume needs the interrupted {what}'s directory: give --out DIR")
            return cls(fresh_dir(Path(default)), "new")
        path = Path(out)
        if path.exists() and not path.is_dir():
            raise KvbenchError(f"--out {path}: is a file, not a directory; give a directory for the {what}")
        if resume:
            if not (path / "summary.json").exists():
                raise KvbenchError(
                    f"--out {path}: no interrupted {what} to resume there (no summary.json); drop --resume to start one"
                )
            return cls(path, "resumed")
        if _holds_something(path):
            if not overwrite:
                raise KvbenchError(
                    f"--out {path}: already holds a {what} ({', '.join(sorted(p.name for p in path.iterdir())[:4])}"
                    f"{', …' if len(list(path.iterdir())) > 4 else ''}); choose another --out, "
                    f"{'continue it with --resume, ' if resumable else ''}or replace it with --overwrite"
                )
            _empty(path)
            return cls(path, "empty")
        existed = path.exists()
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, "empty" if existed else "new")

    def discard(self) -> None:
        """Take back what this command wrote, after a failure before anything was measured."""
        if self.state == "new":
            shutil.rmtree(self.path, ignore_errors=True)
        elif self.state == "empty" and self.path.is_dir():
            _empty(self.path)


def sweep_dir(out: str | None) -> Path:
    """The sweep folder: a given one is resumed when it holds a sweep (sweep.json) and refused when it holds
    anything else; the default is a new folder named after the time."""
    if out is None:
        return fresh_dir(Path("reports") / f"sweep-{stamp()}")
    path = Path(out)
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).exists():
        raise KvbenchError(
            f"--out {path}: holds something that is not a sweep (no {MANIFEST}); give a new or empty folder"
        )
    return path
