"""The one exception type for bad input, and the check that raises it naming the flag."""


class UsageError(ValueError):
    """Bad input, found before any process group starts or anything is written.

    Entry points print it as one line naming the field and the value and exit
    with code 2.
    """


EXIT_USAGE = 2


def check_field(condition: bool, field_name: str, value: object, expectation: str) -> None:
    """Raise ``--field-name=value: expectation`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(f"--{field_name.replace('_', '-')}={value!r}: {expectation}")
