"""``python -m exporter``: the same as the ``policy-export`` command."""

import sys

from policy_export.exporter.cli import main

sys.exit(main())
