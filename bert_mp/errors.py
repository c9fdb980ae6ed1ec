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
