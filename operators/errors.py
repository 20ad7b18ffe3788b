"""The base class of every error a user can fix (issue 41 item 3).

It lives in ``operators`` because operators must not import ``pipeline``, and both raise such errors.
"""

from __future__ import annotations


class PairmineError(Exception):
    """A user-fixable error: bad config, input, model, run id, storage or cluster setting, whose message says what is
    wrong and, where it can, what to change. The CLI (:func:`pipeline.cli.user_error`) prints it as one
    ``pairmine: error: <message>`` line and exits 2, also when it was raised inside a Ray task; any other exception
    is a bug and keeps its traceback.

    Each subclass keeps its builtin base too (``class ConfigError(PairmineError, ValueError)``), so
    ``except ValueError`` / ``except OSError`` still catch it. ``tests/test_errors.py`` checks that every error
    class of ``pairmine.pipeline`` and ``pairmine.operators`` derives from it or is on its allow-list of internal
    errors.
    """
