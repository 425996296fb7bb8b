"""``python -m policy_export.exporter``: the same as the ``policy-export`` command (and ``python -m policy_export``)."""

import sys

from policy_export.exporter.cli import console_main

sys.exit(console_main())
