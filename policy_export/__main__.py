"""``python -m policy_export``: the same as the ``policy-export`` command."""

import sys

from policy_export.exporter.cli import console_main

sys.exit(console_main())
