"""`python -m app.cluster ...` (same as `greenlane cluster ...`)."""

from __future__ import annotations

import sys

from app.cluster.cli import main

sys.exit(main())
