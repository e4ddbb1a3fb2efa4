"""The errors hsx raises, and the exit status the command line gives each: one place for both.

Every problem a user can fix is one of these and prints as one line with no traceback (hsx.cli). Light on
purpose: `import hsx.cli` imports this, not the modules that raise (those import torch).
"""

from __future__ import annotations

import errno

EXIT_RUNTIME = 1  # the data, the model or the output dir cannot be used; a failed verify
EXIT_USAGE = 2  # a flag, recipe key or argument wrong by itself (argparse's own status for a bad flag)
EXIT_INTERRUPTED = 130  # Ctrl-C outside a job's clean stop (128 + SIGINT, as a shell reports it)
INTERRUPTED = "hsx: interrupted; finished units are kept: run the same command to continue"  # its one line


class HsxError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits EXIT_RUNTIME, without a traceback."""


class UsageError(HsxError):
    """A flag, recipe key or argument wrong by itself (before the model or data is read): EXIT_USAGE."""


class ArgumentError(UsageError, ValueError):
    """A library call's argument that does not fit what it is given (an export's `layers` the output does not
    store): the ValueError a Python caller expects, EXIT_USAGE on the command line."""


def usage_line(prog: str, message: str) -> str:
    """A usage error as the command line prints it: one line naming the command and where its flags are listed
    (argparse's own error prints the whole usage first, 29 lines for `hsx extract`)."""
    return f"{prog}: error: {message}; see `{prog} --help`"


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception's message as one line: its lines joined (a library's first line alone may say only which
    validator failed, the next one which key and why), whitespace collapsed, at most `limit` characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_range(name: str, value, low: float, high: float | None = None, integer: bool = True) -> None:
    """UsageError in one line unless `value` (None passes) is a finite number (an int, with `integer`) in
    [low, high]: a negative, NaN, infinite or huge option must not reach numpy or an allocation as a traceback."""
    import math

    ok_type = type(value) is int if integer else type(value) in (int, float)
    if value is None:
        return
    if not ok_type or not math.isfinite(value) or value < low or (high is not None and value > high):
        def shown(x) -> str:
            return "inf" if x is None else f"{x:,}" if type(x) is int else f"{x:g}"

        what = "an integer" if integer else "a number"
        raise UsageError(f"{name} must be {what} in [{shown(low)}, {shown(high)}], not {value!r}")


class VerifyFailed(Exception):
    """`hsx verify` found the output wrong (a damaged file, a count, a state off the reference): EXIT_RUNTIME.
    Not an HsxError: verify turns the HsxErrors of reading OUT into this, so none is caught twice."""


class Stopped(Exception):
    """SIGINT/SIGTERM: the job stopped cleanly after a unit; the same command continues it. Exits with
    `exit_code` (128 + the signal's number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def exit_status(error: BaseException) -> int:
    """The command line's exit status for an error hsx raised."""
    if isinstance(error, Stopped):
        return error.exit_code
    return EXIT_USAGE if isinstance(error, UsageError) else EXIT_RUNTIME


# The file-system errors a user fixes outside hsx (space, quota, a size limit, permissions, a read-only mount, a
# failing disk): what each is, in words, and what to do. Python ignores SIGXFSZ, so `ulimit -f` is EFBIG here.
FILE_SYSTEM_ERRORS = {
    errno.ENOSPC: ("disk full", "free some space"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or raise the quota"),
    errno.EFBIG: ("file too large for the file size limit", "raise the limit (`ulimit -f`) or use another disk"),
    errno.EROFS: ("read-only file system", "make it writable or use another dir"),
    errno.EACCES: ("permission denied", "give this user access to it or use another dir"),
    errno.EPERM: ("operation not permitted", "give this user access to it or use another dir"),
    errno.EIO: ("I/O error", "check the disk (dmesg)"),
}


def file_system_error(error: BaseException) -> OSError | None:
    """The file-system error (FILE_SYSTEM_ERRORS) that `error` is, or was raised while handling, if any. A
    library's cleanup can hide it: datasets' map finalizes its writer again after the write failed, and that raises
    'I/O operation on closed file' with the ENOSPC (or EFBIG) as its context."""
    seen = set()
    while error is not None and id(error) not in seen and len(seen) < 64:
        seen.add(id(error))
        if isinstance(error, OSError) and (error.errno in FILE_SYSTEM_ERRORS or "No space left" in str(error)):
            return error
        error = error.__cause__ or error.__context__
    return None


def file_system_line(error: OSError, where: str | None = None, kept: str = "nothing committed is lost") -> str:
    """One line for a file-system error: what happened, at which path (the error's own, else `where`), what to
    do, what was kept (`kept`), and that the same command continues."""
    what, advice = FILE_SYSTEM_ERRORS.get(error.errno, ("disk full", "free some space"))
    # (the second name of a two-path call is the one written: os.replace's and os.symlink's destination)
    path = next((p for p in (error.filename2, error.filename, where) if p is not None), None)
    path = path if path is None or str(path).isprintable() else ascii(str(path))  # (one line, whatever the name)
    writing = error.errno not in (errno.EACCES, errno.EPERM, errno.EIO)  # (those may be of a read too)
    at = "" if path is None else f" while writing {path}" if writing else f" at {path}"
    return f"{what}{at}: {kept}; {advice} and run the same command to continue"

