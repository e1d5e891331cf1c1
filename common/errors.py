"""The one exception type that the CLI turns into a one-line error and a non-zero exit."""


class UserError(Exception):
    """Bad input or an unusable environment: the message is shown to the user as is."""
