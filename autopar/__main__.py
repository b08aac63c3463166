"""``python -m autopar ...`` is the ``plan`` command."""

import sys

from autopar.cli import main

sys.exit(main())
