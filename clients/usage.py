"""The command line's refusal and its parser, in a module of their own so that the
commands in other files (clients/data_commands.py) raise the very class `interleaf`'s
main catches, also when the CLI runs as `python -m interleaf.clients.cli` (whose module
is then `__main__`), and can ask for a parser of their own kind."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A bad command line or config: one line on stderr, exit status 2, nothing started."""


class Parser(argparse.ArgumentParser):
    """`interleaf`'s parser; its subcommands' parsers are of this class too, and one
    made with intermixed=True takes its positionals wherever they stand among its
    options. argparse's plain parse matches positionals a run at a time: in `export CKPT
    --format hf OUT` the optional OUT (nargs="?") is matched, empty, beside CKPT, and
    the OUT after the option is then refused as unrecognized."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._mixing = False

    def parse_known_args(self, args=None, namespace=None):
        # parse_known_intermixed_args parses twice through this method (options, then
        # positionals), and those passes must be plain ones.
        if not self.intermixed or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False
