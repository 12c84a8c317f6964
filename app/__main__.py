"""`python -m app serve ...`"""

from __future__ import annotations

import sys

from app.cli import main

sys.exit(main())
