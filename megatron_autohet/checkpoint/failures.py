"""What a failed checkpoint save tells: its root cause in one line, its traceback in a log file.

``root_cause(err) -> str`` is the innermost exception of ``err``'s chain (``__cause__``, else the
``__context__`` Python kept), as ``Type: message``: a full disk under torch's zip writer reads
``OSError: [Errno 28] No space left on device``, not the ``unexpected pos 704 vs 598`` raised on
top of it. torch DCP's ``CheckpointException`` (a ``BaseException``) carries each failed rank's
exception, pickled without its chain: its causes are theirs, deduplicated.

``full_disk(directory) -> str | None``: a DCP failure outside the rank's own file writes (the
coordinator's index, say) reaches the other ranks pickled, chain lost (the writer raises a
rank's own write errors from themselves: checkpoint/writer.py ``_dcp_save``), so a rank whose
DCP save failed on a filesystem left without free space reports it as the OSError it was.

``log_traceback(root, text) -> Path | None`` appends a traceback to ``root/ERROR_LOG`` (beside the
steps), or to the temporary directory when ``root`` cannot take it (the disk that failed the
save); None when neither can. One ``write`` per record, so ranks sharing a directory do not
interleave their records.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

ERROR_LOG = "autohet-checkpoint-errors.log"
# A filesystem with less free space than this after a failed write is full (a write fills the
# disk to its last block before it fails, and a few blocks are all a filesystem keeps back).
FULL_BELOW_BYTES = 2**20


def _innermost(err: BaseException) -> BaseException:
    seen = {id(err)}
    while True:
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None or id(inner) in seen:
            return err
        seen.add(id(inner))
        err = inner


def root_cause(err: BaseException) -> str:
    inner = _innermost(err)
    if isinstance(inner, CheckpointException):
        causes = (failure[0] if isinstance(failure, tuple) else failure
                  for failure in inner.failures.values())
        return "; ".join(dict.fromkeys(root_cause(cause) for cause in causes))
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__


def full_disk(directory: Path) -> str | None:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    free = stat.f_bavail * stat.f_frsize
    if free >= FULL_BELOW_BYTES:
        return None
    return (f"OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: '{directory}' "
            f"({free} bytes free)")


def log_traceback(root: Path, text: str) -> Path | None:
    record = f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text}\n".encode()
    for directory in (Path(root), Path(tempfile.gettempdir())):
        path = directory / ERROR_LOG
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, record)
            finally:
                os.close(fd)
            return path
        except OSError:
            continue
    return None
