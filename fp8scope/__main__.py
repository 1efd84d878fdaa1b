"""``python -m fp8scope`` = the ``fp8scope`` command."""

import sys

from fp8scope.cli.main import main

sys.exit(main())
