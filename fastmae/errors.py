"""The one exception type for bad user input (files, fields, configs); command-line tools print it on one line."""

import sys


class FastmaeError(Exception):
    """Bad input that the user can fix: the message names the file, field or value and what is wrong."""


class ConfigError(FastmaeError, ValueError):
    """A bad config value, raised where it is found (the message names the field): a FastmaeError for fastmae's
    commands, a ValueError for code that builds configs itself."""


def run_command(prog: str, fn, *args, fresh_line: bool = False, **kwargs) -> int:
    """Call fn(*args, **kwargs) for the command-line tool `prog`: 0 on success; on bad input a one-line
    `PROG: error: ...` on stderr and 1. fresh_line: start it with a newline, for when another process's progress bar
    may have left the shared stderr mid-line."""
    try:
        fn(*args, **kwargs)
    except FastmaeError as err:
        start = "\n" if fresh_line else ""
        print(f"{start}{prog}: error: {err}", file=sys.stderr)
        return 1
    return 0
