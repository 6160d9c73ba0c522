"""What counts as the user's error: one definition for the library and the command line.

A check of what the user asked for (a config value, a recipe argument, a dataset, a workdir, a
checkpoint of another model) raises one of ``USER_ERROR_TYPES``. ``rope_lie.main`` prints such
an error as one line ``error: <message>`` and exits with status 2; any other exception is a bug
and keeps its traceback. While training, ``user_errors()`` marks the errors raised by those
checks (``is_user_error``), so that a ``ValueError`` from a bug in the loop is still a bug.

It imports nothing beyond the standard library: the command line uses it before JAX loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

USER_ERROR_TYPES = (ValueError, TypeError, KeyError, OSError, IndexError)
_MARK = "_rope_lie_user_error"


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Inside: a ``USER_ERROR_TYPES`` exception is marked as the user's (``is_user_error``) and
    re-raised unchanged (same type and message, for callers of the library)."""
    try:
        yield
    except USER_ERROR_TYPES as e:
        setattr(e, _MARK, True)
        raise


def is_user_error(e: BaseException) -> bool:
    """Whether `e` was raised by a check of the user's input (``user_errors``)."""
    return bool(getattr(e, _MARK, False))
