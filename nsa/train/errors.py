"""The errors a user fixes by changing a setting, a file or an installation."""

from __future__ import annotations


class SetupError(ValueError):
    """The run cannot start (or go on) as set up: a setting, the data, the installation or the
    machine does not fit. The message names what to change; ``nsa train`` prints it as one
    ``nsa: error:`` line."""
