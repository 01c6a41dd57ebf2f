"""The errors of a configuration, apart from config.py so that the modules it imports lazily raise them too."""


class ConfigError(ValueError):
    """A configuration problem. The message is one line that names the key and what it allows."""


class PieceError(ConfigError):
    """model.name, data.source or model.objective names no piece, or names a fork's module that cannot be imported:
    --help stops on it too, since it could not list that piece's keys."""
