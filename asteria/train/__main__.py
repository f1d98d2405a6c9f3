"""``python -m asteria.train``: see `asteria.train.cli`."""

import sys

from asteria.train.cli import main

sys.exit(main())
