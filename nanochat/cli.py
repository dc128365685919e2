"""Command-line habits shared by every entry point: nanochat's dashed flags work as well as our underscored ones."""

import argparse
import enum
import os
import sys


class ExitCode(enum.IntEnum):
    """Every entry point's exit codes, one meaning each; docs/troubleshooting.md#exit-codes lists them for users."""
    OK = 0  # finished as planned (the last step, a spent budget, --early_stop)
    FAILED = 1  # stopped by an error; its one line says what went wrong and what to do
    USAGE = 2  # the command cannot start as given (a flag, an environment variable, a checkpoint or port); nothing ran
    DIVERGED = 3  # training loss or gradient norm went NaN/Inf; nothing saved, the last good checkpoint is untouched
    OUT_OF_MEMORY = 4  # the device ran out of memory; the line names smaller settings
    WRITE_FAILED = 5  # a write failed (full disk, quota, read-only, permissions), a checkpoint save included
    DATA_DAMAGED = 6  # a training shard became unreadable mid-run; the step's checkpoint is saved
    SIGNALED = 128  # plus the signal number (130 Ctrl-C, 143 SIGTERM): stopped by a signal, a training run saved first


# The pyproject.toml extra that installs each optional package, by the name it is imported as
EXTRAS = {"fastapi": "serve", "starlette": "serve", "pydantic": "serve", "uvicorn": "serve", "h11": "serve",
          "prometheus_client": "serve", "httpx": "serve", "openai": "serve", "matplotlib": "plot",
          "transformers": "hf", "tokenizers": "hf", "lm_eval": "eval", "tensorboard": "tensorboard", "wandb": "wandb",
          "pynvml": "gpu"}


def this_python():
    """The interpreter running this code, as a command (.venv/bin/python from the checkout): a bare `python` or `pip`
    may belong to another one (the system's, not .venv's)."""
    here = os.getcwd()
    return os.path.relpath(sys.executable) if sys.executable.startswith(here + os.sep) else sys.executable


def install_command(extra):
    """The command that installs a pyproject.toml extra into the Python running this code."""
    here, root = os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, "pyproject.toml")):  # installed from a wheel, not a checkout
        return f"{this_python()} -m pip install 'nanochat[{extra}]'"
    return f"{this_python()} -m pip install -e '{'.' if root == here else root}[{extra}]'"


def missing_package(error, needs):
    """One line for an optional package that is not installed (error: the ModuleNotFoundError): what needs it and the
    command that installs its extra."""
    name = (getattr(error, "name", None) or str(error)).split(".")[0]
    fix = install_command(EXTRAS[name]) if name in EXTRAS else f"{this_python()} -m pip install {name}"
    return f"{needs} needs {name}, which is not installed; install it with: {fix}"


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


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag's default, unless its help states it already (a default that is not a plain value:
    "autodetect", "the model's sequence_len"), where argparse would add a second, literal one."""

    def _get_help_string(self, action):
        stated = "default" in (action.help or "") or action.required  # a required flag has none
        return action.help if stated else super()._get_help_string(action)


class OneLineErrors(ArgumentParser):
    """A parser whose errors are one line that says what is wrong (the usage is in --help), raised as SystemExit with
    that line, so a caller that parses another tool's flags (launch, compare) can name where they came from."""

    def error(self, message):
        raise SystemExit(f"{self.prog.split()[-1].rsplit('.', 1)[-1]}: error: {message}")


class Exit(SystemExit):
    """Stop an entry point with one line for the user, no traceback, and an ExitCode (FAILED unless given). Uncaught,
    it exits 1 with the line, as any SystemExit does; entry points that report other codes catch it (exit_code)."""

    def __init__(self, message, code=ExitCode.FAILED):
        super().__init__(message)
        self.exit_code = code
