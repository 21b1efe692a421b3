"""The one exception type for bad user input (files, fields, configs); command-line tools print it on one line."""


class FastmaeError(Exception):
    """Bad input that the user can fix: the message names the file, field or value and what is wrong."""
