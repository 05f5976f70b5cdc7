"""``python -m pyro_gradroute``: the ``pyro-gradroute`` command."""

import sys

from .app.cli import main

sys.exit(main())
