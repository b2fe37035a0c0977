"""``python -m compile_runtime.cli``: the ``compile-runtime`` command."""

import sys

from compile_runtime.cli.main import main

sys.exit(main())
