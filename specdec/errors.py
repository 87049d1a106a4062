"""User-facing errors: one line that names the problem and the fix."""


class SpecdecError(Exception):
    """Bad input or environment. The CLI prints ``str(err)`` as one line and exits non-zero."""
