"""pytest plugin for the device run: writes each test's outcome the moment its report arrives
(with xdist too: the controller receives every worker's reports), so a test stage killed at its
timeout still says what passed, what failed and why -- JUnit XML is written only at the end,
and the first H200 run lost it that way (its stage ended at 95%, every benchmark gate closed).

* ``$FASTRL_OUTCOMES``: first a ``collected<TAB>nodeid`` line per test the session will run,
  then one line a test as it ends, ``OUTCOME<TAB>nodeid`` (``passed``, ``failed``, ``skipped``;
  a failing setup or teardown is a ``failed`` line of its own), read by ``tests_passed.py``: a
  collected test without an outcome was not reached;
* ``$FASTRL_FAILURES``: each failure's id and the end of its traceback.

``python -m pytest -p stream_outcomes ...`` with ``benchmarks/gpu`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import os

MAX_CHARS = 3000
"""Characters kept of each failure's traceback (its end: the assertion and the values)."""


def _append(env: str, text: str) -> None:
    path = os.environ.get(env)
    if path:
        with open(path, "a") as f:
            f.write(text)


def pytest_collection_finish(session):
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # one process writes the list (xdist's workers collect alike)
        _append("FASTRL_OUTCOMES", "".join(f"collected\t{item.nodeid}\n" for item in session.items))


def pytest_runtest_logreport(report):
    if report.failed:
        _append("FASTRL_OUTCOMES", f"failed\t{report.nodeid}\n")
        _append("FASTRL_FAILURES", f"=== {report.nodeid} ({report.when})\n{(report.longreprtext or '')[-MAX_CHARS:]}\n")
    elif report.when == "call" or report.skipped:
        _append("FASTRL_OUTCOMES", f"{report.outcome}\t{report.nodeid}\n")
