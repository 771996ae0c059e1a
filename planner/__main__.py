"""``python -m planner``: the one place the core points up, to dispatch to the application's tools."""

import sys

from dsv32_engine.serving.cli import main

sys.exit(main())
