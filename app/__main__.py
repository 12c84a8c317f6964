"""`python -m app serve ...`"""

from __future__ import annotations

import sys

from app.cli import main

# Guarded: the engine core runs in a spawned process, which imports this module again.
if __name__ == "__main__":
    sys.exit(main())
