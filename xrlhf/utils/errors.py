"""User-facing errors: one line naming the place and the fix, exit status 2, no traceback."""


class UserError(Exception):
    """A problem with the user's input (config, paths, datasets, reward functions).

    The CLI prints each message on its own line and exits with status 2.

    Args:
        messages: one or more lines, each naming the place (YAML path, file:line) and the fix.
    """

    def __init__(self, *messages: str):
        self.messages = [m for m in messages if m]
        super().__init__("\n".join(self.messages))


class WorkerDiedError(RuntimeError):
    """A Ray worker of a model handle died (or stopped answering); names the handle and the rank.

    Attributes:
        handle: the handle's name (``policy``, ``rollout``, ...), or ``None`` when unknown.
        rank: the rank that died, or ``None``.
        worker: the dead worker's actor handle, or ``None`` (tells a healer whether it was
            replaced already).
        step: the RL step under way when it died (set by the runner), or ``None``.
    """

    def __init__(self, message: str, handle: str | None = None, rank: int | None = None, worker=None):
        super().__init__(message)
        self.handle, self.rank, self.worker = handle, rank, worker
        self.step: int | None = None


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with NaN/inf rewards or losses (``fault_tolerance.max_bad_steps``)."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (Ray's carry a traceback below it), or its type."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
