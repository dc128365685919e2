"""Command-line habits shared by every entry point: nanochat's dashed flags work as well as our underscored ones."""

import argparse
import sys


def underscore_flags(argv):
    """--device-batch-size=8 -> --device_batch_size=8; values and everything after a bare '--' are left alone."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            out[i] = "--" + name[2:].replace("-", "_") + sep + value
    return out


class ArgumentParser(argparse.ArgumentParser):
    """argparse that accepts --flag-name for every --flag_name (argparse itself has no option for it)."""

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(underscore_flags(sys.argv[1:] if args is None else args), namespace)


class OneLineErrors(ArgumentParser):
    """A parser whose errors are one line that says what is wrong (the usage is in --help), raised as SystemExit with
    that line, so a caller that parses another tool's flags (launch, compare) can name where they came from."""

    def error(self, message):
        raise SystemExit(f"{self.prog.split()[-1].rsplit('.', 1)[-1]}: error: {message}")


class Exit(SystemExit):
    """Stop an entry point with one line for the user, no traceback, and an exit code (1 unless given). Uncaught, it
    exits 1 with the line, as any SystemExit does; entry points that report other codes catch it and use exit_code."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.exit_code = code
