"""The one exception type for bad user input (files, fields, configs); command-line tools print it on one line."""

import sys


class FastmaeError(Exception):
    """Bad input that the user can fix: the message names the file, field or value and what is wrong."""


def run_command(prog: str, fn, *args, **kwargs) -> int:
    """Call fn(*args, **kwargs) for the command-line tool `prog`: 0 on success; on bad input a one-line
    `PROG: error: ...` on stderr and 1."""
    try:
        fn(*args, **kwargs)
    except FastmaeError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    return 0
