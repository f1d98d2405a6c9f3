"""``python -m asteria.train``: see `asteria.train.cli` (through `asteria.train.extra.main`,
which says which extra to install when the job's packages are missing)."""

import sys

from asteria.train.extra import main

sys.exit(main())
