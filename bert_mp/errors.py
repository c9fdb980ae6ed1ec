"""Errors a user can act on. The CLI prints these as one line, without a traceback."""


class BertMPError(Exception):
    """Base class: an actionable problem with the user's input, config or hardware."""


class ConfigError(BertMPError, ValueError):
    """A config key has an unknown name or an invalid value; the message names the key."""


class DataError(BertMPError, ValueError):
    """The corpus or prepared data cannot be used as asked."""


class HardwareError(BertMPError, RuntimeError):
    """The requested precision or feature is not available on this device."""


class TrainingError(BertMPError, RuntimeError):
    """Training stopped on purpose (divergence, loss-scale collapse); state was saved first."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while data was prepared; ``detail`` says what was left on disk.

    The CLI prints :meth:`line` and exits ``128 + signum`` (a SIGTERM there prints the same line
    and exits 143 at once). A ``KeyboardInterrupt``, so ``except Exception`` blocks let it through.
    """

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signum, detail)
        self.signum, self.detail = int(signum), detail

    def line(self, command: str) -> str:
        """``bert-mp <command>: interrupted (SIGINT); <detail>``."""
        import signal

        name = signal.Signals(self.signum).name
        return f"bert-mp {command}: interrupted ({name})" + (f"; {self.detail}" if self.detail else "")


class StorageError(TrainingError):
    """A write failed (disk full, I/O error, permissions): the partial output was removed and what was
    complete before is intact. The CLI exits with ``exit_code`` (4); a training run records it as
    failed, like any :class:`TrainingError`."""

    exit_code = 4


class BertMPWarning(UserWarning):
    """A warning the CLI prints as one line (``bert-mp <command>: warning: ...``), without the source line."""
