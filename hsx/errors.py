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


def disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised while handling, is a full disk or quota (ENOSPC, EDQUOT).
    A library's cleanup can hide it: datasets' map finalizes its writer again after the write failed, and that
    raises 'I/O operation on closed file' with the ENOSPC as its context."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and (error.errno in (errno.ENOSPC, errno.EDQUOT)
                                           or "No space left" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False
