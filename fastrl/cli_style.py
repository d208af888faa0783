"""The one convention every ``fastrl`` command line follows.

- Spelling: options are spelled with underscores, as ``TrainConfig``'s fields and the keys
  of a ``--config`` YAML file (``--group_size 8``). The same name with dashes is accepted as
  an alias (``--group-size 8``): ``normalize_spelling`` rewrites it before parsing.
- No prefix matching: ``--step 5`` is an error, not ``--steps 5`` (``allow_abbrev=False``).
- A parse error prints the one-line usage, the error and the closest option names
  (``difflib``), not the whole option list; exit status 2.
- A user's mistake found later (``fastrl.errors.InputError``) prints as one line,
  ``fastrl <command>: error: <message>``, exit status 2; ``--debug`` (anywhere on the command
  line) or ``FASTRL_DEBUG=1`` shows its traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Callable, Iterable, NoReturn

DEBUG_FLAG = "--debug"
DEBUG_ENV = "FASTRL_DEBUG"
USAGE_ERROR_STATUS = 2


def canonical_option(token: str) -> str:
    """``--foo-bar`` -> ``--foo_bar`` (the option name only; ``=value`` is kept as given)."""
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


def normalize_spelling(argv: Iterable[str], known: Iterable[str]) -> list[str]:
    """``argv`` with every dashed option that names a ``known`` underscored option rewritten
    to the underscored spelling. Values and unknown options are left alone (the parser then
    reports those); nothing after a bare ``--`` is touched."""
    known = set(known)
    out: list[str] = []
    args = list(argv)
    for i, token in enumerate(args):
        if token == "--":
            out.extend(args[i:])
            break
        fixed = canonical_option(token)
        out.append(fixed if fixed.partition("=")[0] in known else token)
    return out


def closest_options(token: str, known: Iterable[str], *, n: int = 3) -> list[str]:
    """The known option names closest to ``token`` (either spelling), best first."""
    name = canonical_option(token.partition("=")[0])
    options = sorted({k for k in known if k.startswith("--")})
    return difflib.get_close_matches(name, options, n=n, cutoff=0.6)


def one_line(message: str) -> str:
    """A parser's (possibly multi-line) message as one line, options named as on the command line."""
    message = re.sub(r'Parser key "([^"]+)":', r"--\1:", message)
    return " ".join(message.split())


def explain(message: str, known: Iterable[str]) -> str:
    """The error line, with "did you mean" for each unrecognized option."""
    known = list(known)
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        options = re.findall(r"'([^']*)'", choice.group(2)) or [c.strip() for c in choice.group(2).split(",")]
        close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.6)
        return one_line(message) + (f" (did you mean {close[0]}?)" if close else "")
    match = re.match(r"unrecognized arguments: (.*)", message)
    if not match:
        return one_line(message)
    parts = []
    for token in match.group(1).split():
        if not token.startswith("-"):
            continue
        close = closest_options(token, known)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        parts.append(f"unknown option {token.partition('=')[0]}{hint}")
    if not parts:  # only stray positional words
        return f"unexpected argument(s): {match.group(1)}"
    return "; ".join(parts)


def print_usage_error(prog: str, message: str, known: Iterable[str], *, file=None) -> None:
    """What every fastrl parser prints on a parse error: usage line, error line, where the help is."""
    file = sys.stderr if file is None else file
    print(f"usage: {prog} [OPTIONS]   ({prog} --help lists them)", file=file)
    print(f"{prog}: error: {explain(message, known)}", file=file)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with fastrl's convention (module docstring): option names
    registered with dashes are stored with underscores, dashes are accepted as an alias, no
    prefix matching, short errors. Subparsers made with ``add_subparsers`` use it too."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        return super().add_argument(*(canonical_option(n) for n in names), **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        plain = group.add_argument
        group.add_argument = lambda *names, **kw: plain(*(canonical_option(n) for n in names), **kw)
        return group

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(normalize_spelling(args, self._option_string_actions), namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the (sub)command they were given to, with its option names
            target = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(namespace, action.dest, None) in action.choices:
                    target = action.choices[getattr(namespace, action.dest)]
            target.error("unrecognized arguments: " + " ".join(extras))
        return namespace

    def error(self, message: str) -> NoReturn:
        print_usage_error(self.prog, message, self._option_string_actions)
        self.exit(USAGE_ERROR_STATUS)


def pop_debug(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (before a bare ``--``), and whether debugging is on
    (the flag or ``FASTRL_DEBUG=1``)."""
    end = argv.index("--") if "--" in argv else len(argv)
    debug = DEBUG_FLAG in argv[:end]
    kept = [a for a in argv[:end] if a != DEBUG_FLAG] + argv[end:]
    return kept, debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_reporting_input_errors(command: str, fn: Callable[[], int], *, debug: bool) -> int:
    """Run ``fn``; an ``InputError`` escaping it prints as one line and returns status 2
    (with ``debug``: re-raised, so the traceback shows)."""
    from fastrl.errors import InputError

    try:
        return fn()
    except InputError as exc:
        if debug:
            raise
        print(f"fastrl {command}: error: {one_line(str(exc))}", file=sys.stderr)
        return USAGE_ERROR_STATUS
