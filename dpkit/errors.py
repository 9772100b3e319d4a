"""The one exception type for bad input."""


class UsageError(ValueError):
    """Bad input, found before any process group starts or anything is written.

    Entry points print it as one line naming the field and the value and exit
    with code 2.
    """


EXIT_USAGE = 2
