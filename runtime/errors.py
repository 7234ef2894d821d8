"""Error type shared by the exporter and the runtime."""


class DFlashError(Exception):
    """A user-facing error: the message names the problem and the fix.

    Raised for bad input (a missing or mismatched checkpoint, a prompt that does not fit the
    KV buffers, a manifest from another version, ...). The command-line tools print the message
    alone, without a traceback, and exit with status 2.
    """
