"""The error types that mean "the input is wrong" (shown to users as one line, exit code 2).

They live here, below every package, so that convert/, store/ and engine/ raise them without
importing each other."""

from moestream.config import ConfigError


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as is; the message names the file or tensor."""


class TokenizerError(ValueError):
    """Tokenizer files that are missing, unreadable or do not belong to the model."""


USER_ERRORS = (ConfigError, CheckpointError, TokenizerError, FileNotFoundError)


class RankError(RuntimeError):
    """Expert parallelism: another rank died, hung past the timeout or never joined. Not the
    user's input (exit code 1), but one line naming what stopped, never a hang."""
