"""The command line's refusal, in a module of its own so that the commands in other files
(clients/data_commands.py) raise the very class `interleaf`'s main catches, also when the
CLI runs as `python -m interleaf.clients.cli` (whose module is then `__main__`)."""


class UsageError(Exception):
    """A bad command line or config: one line on stderr, exit status 2, nothing started."""
