"""User-facing errors: one line that names the key, file, tensor or layer at fault."""


class MegatrainError(Exception):
    """A mistake in the user's input or environment. The CLI prints it without a traceback."""


class ConfigError(MegatrainError):
    """One or more invalid configuration keys; the message lists every problem at once."""
