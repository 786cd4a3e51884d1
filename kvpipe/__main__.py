"""`python -m kvpipe ...`: the same CLI as the `kvpipe` console script."""

import sys

from kvpipe.cli import main

sys.exit(main())
