"""The errors of a configuration (accumulation/config/config.py), in a module of their own so that the modules
config.py imports only on their paths (own_keys.py, text_checks.py) raise them too."""


class ConfigError(ValueError):
    """A configuration problem. The message is one line that names the key and what it allows."""


class PieceError(ConfigError):
    """model.name, data.source or model.objective names no piece, or names a fork's module that cannot be imported:
    --help stops on it too, since it could not list that piece's keys."""
