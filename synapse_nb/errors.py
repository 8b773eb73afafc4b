"""The one exception class users see."""


class SynapseError(Exception):
    """A problem with the user's input (file, key, tensor, type, option).

    The message is one line naming the file and the problem; the CLI prints it
    to stderr and exits with status 2, without a traceback.
    """
