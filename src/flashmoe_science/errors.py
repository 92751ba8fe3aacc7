"""Errors a command reports to its user as one line (the `flashmoe-science` entry point prints the message and exits
with status 2; `--debug` shows the traceback instead)."""


class CommandError(Exception):
    """A problem with what the user asked for (a file, an option, the data), stated with its fix in one line."""
