"""Where a dump is written, and how it lands: nothing half-written, nothing of the user's lost.

The rules of --out, for every writer: megalign's runs (run/launch.py claims and lands the folder
its workers write into) and megalign.Dumper (capture/dumper.py, rank 0 claims and lands it).

Ranks write into `OUT.partial`, made with an exclusive mkdir and marked with a `.megalign-run`
file naming the writer (pid, host). Only when every rank has finished is it renamed to OUT, so a
failed, killed or timed-out run leaves nothing behind, and two writers with the same OUT cannot mix:
the second finds the first's staging folder and stops with an error. A folder the user made is
never removed: a stale `OUT.partial` is cleared only when its marker names a process of this host
that is gone, and `--overwrite` replaces only a folder that is provably a megalign dump.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterator

from megalign.dump.format import DUMP_META, FORMAT, MANIFEST
from megalign.errors import UserError

MARKER = ".megalign-run"
_RANK_DIR = re.compile(r"^rank-\d{5}$")


def staging_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def aside_dir(out: Path) -> Path:
    """Where --overwrite moves the old dump while the new one is renamed into place."""
    return out.with_name(f".{out.name}.megalign-replaced-{os.getpid()}")


# How each folder that may replace a megalign dump is told to: megalign's --out, and a Dumper's out.
DUMPER_OUT = "Dumper out"
REPLACE_WITH = {"--out": "--overwrite", DUMPER_OUT: "overwrite=True"}


def check_out(out: Path, overwrite: bool, flag: str = "--out") -> None:
    """Refuse, before anything starts, an --out that cannot be written or must not be replaced. The same
    rules hold for every folder a run lands (--save's checkpoint: `flag` names the option in messages)."""
    try:
        _check_out(out, overwrite, flag)
    except OSError as e:  # e.g. a name the file system cannot hold (ENAMETOOLONG)
        raise UserError(f"{flag} {out}: {e.strerror}") from None


def _check_out(out: Path, overwrite: bool, flag: str) -> None:
    if out.is_symlink():
        # Landing renames a folder onto OUT: onto a link it would replace the link, not the dump it points to.
        raise UserError(f"{flag} {out} is a symbolic link; give the folder itself ({os.path.realpath(out)})")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} exists and is not a folder")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise UserError(f"{flag} {out} is the working folder or holds it; give a folder of its own, e.g. dumps/run1")
    ancestor = resolved.parent  # the folders up to it are made by the run
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} {out}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK):
        raise UserError(f"{flag} {out}: {ancestor} is not writable")
    _check_name_length(out, ancestor, flag)
    staging = staging_dir(out)
    if staging.exists() and not staging.is_dir():
        raise UserError(f"{flag} {out}: {staging} exists and is not a folder; move it away")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            replace = REPLACE_WITH.get(flag)
            raise UserError(f"{flag} {out} exists and is not empty; " + (f"pass {replace} to replace it (only a "
                            "megalign dump is ever replaced)" if replace else "give a new or empty folder"))
        check_replaceable(out, flag)


def check_apart(out: Path, other: Path, flag: str) -> None:
    """Refuse two folders a run lands (--out and `flag`'s, --save) where one is, or is inside, the other or
    its staging folder: landing the outer would find the inner's folder in it and refuse, the run's work lost."""
    ours, theirs = _landed(out), _landed(other)
    if any(a.is_relative_to(b) or b.is_relative_to(a) for a in ours for b in theirs):
        raise UserError(f"{flag} {other} and the dump's folder (--out {out}) are one inside the other; give each a "
                        "folder of its own, side by side")


def _landed(folder: Path) -> tuple[Path, Path]:
    """The folders landing `folder` makes: the staging folder, then the folder itself."""
    resolved = folder.resolve()
    return staging_dir(resolved), resolved


def _check_name_length(out: Path, folder: Path, flag: str) -> None:
    """The folders made beside OUT have longer names than OUT's: each must fit the file system, or
    the run would fail after its work is done."""
    limit = os.pathconf(folder, "PC_NAME_MAX")
    longest = max(len(os.fsencode(d.name)) for d in (staging_dir(out), aside_dir(out)))
    if longest > limit:
        raise UserError(f"{flag} {out}: the name is too long (megalign's staging folders beside it add "
                        f"{longest - len(os.fsencode(out.name))} characters; the file system takes {limit})")


def check_replaceable(out: Path, flag: str) -> None:
    """--overwrite removes OUT only when it is a megalign dump and holds neither the working folder nor a parent
    of it. `flag`: what OUT is to the user, a REPLACE_WITH key (the Dumper's out says overwrite=True); a
    folder of another option (--save has no overwrite) is refused as one line too, not a KeyError."""
    replace = REPLACE_WITH.get(flag, "megalign")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise UserError(f"{flag} {out} is the working folder or holds it; {replace} will not replace it")
    meta = _megalign_json(out / DUMP_META)
    if meta is None:
        raise UserError(f"{flag} {out} is not a megalign dump (no megalign {DUMP_META} in it); {replace} only "
                        "replaces megalign dumps")
    foreign = _foreign(out, meta)
    if foreign:
        raise UserError(f"{flag} {out} is not a megalign dump (it holds {', '.join(foreign[:3])}"
                        f"{' ...' if len(foreign) > 3 else ''}); {replace} only replaces megalign dumps")


def _foreign(out: Path, meta: dict) -> list[str]:
    """Everything in OUT, at any depth, that neither its dump.json nor its ranks' manifests name:
    a user's file inside a rank folder is theirs as much as one beside dump.json."""
    world = meta.get("world_size")
    foreign = []
    for path in sorted(out.iterdir()):
        if path.name in _own_files(DUMP_META) and _is_plain_file(path):
            continue
        if _RANK_DIR.match(path.name) and isinstance(world, int) and int(path.name[5:]) < world \
                and path.is_dir() and not path.is_symlink():
            foreign += [f"{path.name}/{name}" for name in _foreign_in_rank(path)]
        else:
            foreign.append(path.name)
    return foreign


def _foreign_in_rank(rank_dir: Path) -> list[str]:
    manifest = _megalign_json(rank_dir / MANIFEST) or {}
    tensors = manifest.get("tensors") if isinstance(manifest.get("tensors"), list) else []
    named = {t["file"] for t in tensors if isinstance(t, dict) and isinstance(t.get("file"), str)}
    ours = named | (_own_files(MANIFEST) if manifest else set())
    return sorted(p.name for p in rank_dir.iterdir() if not (p.name in ours and _is_plain_file(p)))


def _own_files(json_name: str) -> set[str]:
    """A JSON file of the dump and the temporary file it is written through (format.write_json_atomic)."""
    return {json_name, f".{json_name}.tmp"}


def _is_plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _megalign_json(path: Path):
    """The JSON object in `path` when it is megalign's (its "format" says so), else None."""
    try:
        raw = json.loads(path.read_text()) if _is_plain_file(path) else None
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT else None


def _claim(staging: Path, flag: str) -> None:
    """Create the staging folder exclusively; clear one left by a dead megalign run of this host."""
    try:
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as e:
        if not isinstance(e, FileExistsError):
            raise UserError(f"cannot create {staging}: {e.strerror}") from None
        owner = _owner(staging)
        if owner is None:
            raise UserError(f"{staging} exists and is not a megalign staging folder; move it away") from None
        if owner.get("host") != socket.gethostname() or _alive(owner.get("pid")):
            raise UserError(f"another megalign run (pid {owner.get('pid')} on {owner.get('host')}) is writing "
                            f"{staging}; wait for it or choose another {flag}") from None
        shutil.rmtree(staging)  # a crashed run of ours: its marker says so
        staging.mkdir()
    try:
        (staging / MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    except OSError as e:  # a full disk: the folder was made just now, and holds nothing else
        shutil.rmtree(staging)
        raise UserError(f"cannot create {staging}: {e.strerror}") from None


def _owner(staging: Path):
    try:
        owner = json.loads((staging / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _land(staging: Path, out: Path, overwrite: bool, flag: str) -> None:
    """Rename the finished staging folder to OUT. A replaced dump is moved aside first and removed
    after, so that OUT is at every moment either the old dump or the new one."""
    (staging / MARKER).unlink()
    old = None
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"{flag} {out} was filled by something else during the run; what this run wrote "
                            f"is left in {staging}")
        check_replaceable(out, flag)
        old = aside_dir(out)
        os.replace(out, old)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def staged(out: Path, overwrite: bool, owner: bool = True, flag: str = "--out") -> Iterator[Path]:
    """Yield OUT.partial to write into; rename it to OUT once the block succeeds, remove it if not.

    Only the owner (node 0) creates, lands or removes the folder; other nodes' workers write into it.
    Of the owner, the process that claimed it: a forked child's copy of this generator is closed
    when the child ends (GeneratorExit here), and must leave the parent's folder alone.
    """
    staging = staging_dir(out)
    if owner:
        _claim(staging, flag)
    claimer = os.getpid()
    try:
        yield staging
    except BaseException:
        if owner and os.getpid() == claimer:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if owner:
        _land(staging, out, overwrite, flag)
