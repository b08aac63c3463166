"""``python -m autopar ...`` is the ``plan`` command."""

import sys

try:
    from autopar.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing
    sys.stderr.write("error: interrupted (Ctrl-C): nothing was written\n")
    sys.exit(130)

sys.exit(main())
