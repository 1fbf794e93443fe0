"""``python -m omni_accum.cli``: the same as the ``omni-accum`` command."""

import sys

from omni_accum.cli.main import main

sys.exit(main())
