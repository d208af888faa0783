"""The exception types that tell a user's mistake from a fault in fastrl.

`InputError` is a mistake in what the user gave fastrl (an option, a file, a dataset, a
model folder, a reward spec). The command line prints its message as one line,
`fastrl <command>: error: <message>`, and exits with status 2, without a traceback
(`--debug` or `FASTRL_DEBUG=1` shows it). It subclasses `ValueError`, so code and tests
that catch `ValueError` keep working. Raise it with a message that names the option or
the file, and say what would be accepted.

Anything else that escapes is a fault and keeps its traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """A mistake in the user's input: shown as one line, exit status 2."""
