"""The error types that mean "the input is wrong" (shown to users as one line, exit code 2)."""

from moestream.config import ConfigError
from moestream.convert.hf import CheckpointError
from moestream.engine.tokenizer import TokenizerError

USER_ERRORS = (ConfigError, CheckpointError, TokenizerError, FileNotFoundError)
