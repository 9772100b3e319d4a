"""``python -m dpkit``: the ``dpkit`` command, run by this interpreter (what the commands
dpkit writes for a user name, so that they work without a virtualenv on ``PATH``)."""

import sys

from dpkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
