"""The one exception class users see, and the one-line form its messages are printed in."""


class SynapseError(Exception):
    """A problem with the user's input (file, key, tensor, type, option).

    The message is one line naming the file and the problem; the CLI prints it
    to stderr and exits with status 2, without a traceback.
    """


def one_line(msg, limit: int = 500) -> str:
    """An error message as one printable line: control characters (a newline in a file name, a
    corrupted key swallowing binary bytes) escaped, and at most `limit` characters (then "...")."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg))
    return out if len(out) <= limit else out[:limit] + "..."
