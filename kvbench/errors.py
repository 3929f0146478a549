"""User-facing errors: the CLI prints their message on one line and exits non-zero, never a traceback."""


class KvbenchError(Exception):
    """An error caused by the user's input or environment; the message says what is wrong and what to do."""

    exit_code = 2


class TraceFormatError(KvbenchError):
    """A trace or source file that cannot be read, with the file (and column/row where known) named."""


class ValidationFailed(KvbenchError):
    """A trace that breaks schema rules; `report` holds every violation found."""

    exit_code = 1

    def __init__(self, report):
        self.report = report
        super().__init__(report.summary())


class KvbenchWarning(UserWarning):
    """Something the user asked for and did not get in full (a part of a run skipped, and why); the CLI prints
    it as one line."""
