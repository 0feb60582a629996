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
    """A Ray worker of a model handle died; names the handle and the rank."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with NaN/inf rewards or losses (``fault_tolerance.max_bad_steps``)."""
