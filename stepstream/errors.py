"""Errors of the front (the command line and the HTTP server it starts), shared by its parts."""

from __future__ import annotations

from eventstore.errors import StepstreamError


class UsageError(StepstreamError):
    """An option the command cannot use; the message names it."""
