"""Errors that are the user's to fix (bad config, bad input, unavailable backend): the CLI prints their
message and exits with status 2, without a traceback."""


class UserError(Exception):
    """A problem the user can fix; the message names it."""


class EngineDead(Exception):
    """The engine loop stopped (an error in a step, or shutdown), or no engine instance behind a router is
    live: a request cannot be served now (HTTP 503)."""


class GraphCaptureWarning(UserWarning):
    """A decode step's graph capture failed: the engine runs eagerly from then on (the message says why). Here, not in
    core/engine/graphs.py, so that naming it (pyproject's ``filterwarnings``, which pytest resolves in its main process
    too) imports no torch: through graphs.py the suite's controller process imported torch for it (0.19 GiB PSS)."""
