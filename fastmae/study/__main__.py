"""`python -m fastmae.study`."""

import sys

from .command import main

sys.exit(main())
