"""``python -m pyro_gradroute``: the ``pyro-gradroute`` command."""

import sys

from .cli import main

sys.exit(main())
