"""``python -m kvdisagg.cli``: the ``kvdisagg`` command (tests and the local fleet run it so)."""

import sys

from kvdisagg.cli import main

sys.exit(main())
