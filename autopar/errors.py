"""The one user-error type: a mistake in what the user gave (a flag, a file, a plan), not a bug.

Its message is one line naming the value, the rule it breaks and the fix. The CLI prints it as
``error: <message>`` and exits 2; every other exception is a bug, shown with its traceback and
exit code 1. This module imports nothing from autopar, so every package may import it.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """A user error: one line (value, rule, fix). Subclassed by each package's own errors
    (``ModelFileError``, ``TraceError``, ``ClusterSpecError``, ``PlanningError``, ``PlanError``,
    ...); a ``ValueError`` so that callers catching ``ValueError`` keep working."""
