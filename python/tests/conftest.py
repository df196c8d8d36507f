"""Plain ``pytest python/tests`` runs the single-process tests; ``gpu/`` needs torchrun (see its conftest)."""

import os

collect_ignore = [] if "RANK" in os.environ else ["gpu"]
