"""Folders that a command writes at a path the user names: nothing the user put there is ever deleted.

Every command that writes (or replaces) a folder the user names (``trial --folder``, ``export``, ``derive``,
``compare --out``) first calls ``claim(dest, kind)``. It lets the command go on only when ``dest`` is new, an empty
folder, or that command's own earlier output: a folder holding the mark ``.eagle3kit-output.json`` that the command
wrote, whose list names every entry there (a file the user added beside it makes the folder the user's again).
``force=True`` (the commands' ``--force``) is the user saying the folder may be replaced. A file at ``dest`` is
always refused. ``mark(folder, kind)`` writes the mark once the command has written the folder.
"""
from __future__ import annotations

import json
from pathlib import Path

MARK = ".eagle3kit-output.json"


class FolderError(ValueError):
    pass


def own_entries(folder: Path, kind: str) -> set[str] | None:
    """The entries ``kind`` recorded writing in ``folder`` (None: no mark of ``kind`` there)."""
    try:
        m = json.loads((Path(folder) / MARK).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("kind") != kind or not isinstance(m.get("entries"), list):
        return None
    return {str(e) for e in m["entries"]}


def claim(dest, kind: str, force: bool = False, flag: str = "--force") -> bool:
    """Whether ``dest`` holds something ``kind`` will replace (False: new or empty). Raises ``FolderError`` naming
    ``dest``, what in it is not ``kind``'s own, and the fix, when ``kind`` may not write there; changes nothing."""
    dest = Path(dest)
    if not dest.exists() and not dest.is_symlink():
        return False
    if not dest.is_dir():
        raise FolderError(f"{dest} is a file: {kind} writes a folder there. Fix: give a new folder (nothing was "
                          f"changed)")
    entries = sorted(p.name for p in dest.iterdir())
    if not entries:
        return False
    if force:
        return True
    own = own_entries(dest, kind)
    foreign = [e for e in entries if e != MARK and (own is None or e not in own)]
    if not foreign:
        return True
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    whose = f"not written by eagle3kit {kind}" if own is None else f"that eagle3kit {kind} did not write"
    raise FolderError(f"{dest} is not empty: it holds {shown}, {whose}; {kind} would replace the folder. Fix: give a "
                      f"new or empty folder, or pass {flag} to replace it (nothing was changed)")


def mark(folder, kind: str, extra=()) -> None:
    """Record ``folder`` (and every entry in it now, plus ``extra`` names) as ``kind``'s own output."""
    folder = Path(folder)
    names = {p.name for p in folder.iterdir() if p.name != MARK} | set(extra)
    tmp = folder / (MARK + ".tmp")
    tmp.write_text(json.dumps({"kind": kind, "entries": sorted(names)}, indent=1))
    tmp.replace(folder / MARK)
