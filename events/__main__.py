"""``python -m events``: the ``kv-events`` command line."""

import sys

from events.tools.cli import main

sys.exit(main())
