"""``python -m exporter``: the same as the ``policy-export`` command."""

import sys

from exporter.cli import main

sys.exit(main())
