"""Errors raised for bad configuration or bad input data."""


class ConfigError(ValueError):
    """A configuration value or an input file is invalid.

    The message always names the offending config key (e.g. ``optimizer.lr``) or file,
    and says what is allowed.
    """
