"""An argparse tree whose commands fill in their options only when the command line picks them.

`backfill --help` lists every command with one line of help; building each command's options
would import the config dataclasses, torch and the server behind them, for nothing. So each
command is registered with a function that adds its options (`defer`), called only for the
command the arguments name, or for every command when the whole tree is wanted (tests, docs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

Fill = Callable[[argparse.ArgumentParser], None]


class CommandParser:
    def __init__(self, prog: str, description: str | None, argv: list[str] | None = None,
                 announce: Callable[[str], None] | None = None) -> None:
        """argv: the arguments about to be parsed (only their command is filled); None fills all.
        announce gets the line "prog command: help" of the command argv names, before its options are
        filled (which may import torch: seconds on a busy machine), unless argv asks for --help."""
        self.parser = argparse.ArgumentParser(prog=prog, description=description)
        self._argv = argv
        self._announce = None if argv is None or {"-h", "--help"} & set(argv) else announce
        self._groups: dict[str, argparse._SubParsersAction] = {
            "": self.parser.add_subparsers(dest="command", required=True)}

    def group(self, name: str, help: str) -> None:
        """A command made of subcommands (`backfill bench ...`); its subcommands are deferred with
        paths "name sub"."""
        parser = self._groups[""].add_parser(name, help=help, description=help, add_help=self.wants(name))
        if self.wants(name):
            self._groups[name] = parser.add_subparsers(dest=name.replace("-", "_"), required=True)

    def defer(self, path: str, help: str, fill: Fill, **parser_options) -> None:
        """Register the command at path ("serve", "bench coserve"); fill(parser) adds its options and
        sets its func, and runs only if the arguments being parsed name this command."""
        *group, name = path.split()
        if group and not self.wants(" ".join(group)):
            return  # the arguments go down another branch: nothing here is parsed or listed
        wanted = self.wants(path)
        if not wanted:
            parser_options["add_help"] = False  # never parsed, only listed: a cheaper parser
        parser_options.setdefault("description", help)
        parser = self._groups[" ".join(group)].add_parser(name, help=help, **parser_options)
        if wanted:
            # What the command does, as its first line: importing its modules, loading a model or
            # building a kernel before its own output can take minutes on a slow machine.
            if self._announce is not None:
                self._announce(f"{self.parser.prog} {path}: {help}")
            fill(parser)

    def wants(self, path: str) -> bool:
        words = path.split()
        return self._argv is None or self._argv[:len(words)] == words
