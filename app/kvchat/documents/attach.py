"""A path a user named (``kvchat ask --attach PATH``, the app's picker) → its documents."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvchat.documents.bounds import DEFAULT_BOUNDS, ReadBounds
from kvchat.documents.document import Attachment, refuse
from kvchat.documents.folders import read_folder
from kvchat.documents.reading import open_problem, read_document


def attach(
    path: str | os.PathLike[str], *, glob: str | None = None, bounds: ReadBounds = DEFAULT_BOUNDS
) -> Attachment:
    """The documents of the file or folder a user named (a link the user named is followed);
    ``glob`` picks a folder's files. One :class:`~kvchat.errors.DocumentError` line for a
    path kvchat will not read."""
    where = Path(path)
    try:
        info = os.stat(where)
    except OSError as exc:
        raise refuse(str(where), open_problem(exc)) from None
    if stat.S_ISDIR(info.st_mode):
        return read_folder(where, glob=glob, bounds=bounds)
    if glob is not None:
        raise refuse(str(where), "is a file; a glob picks files of a folder only")
    return Attachment((read_document(where, bounds=bounds),))
