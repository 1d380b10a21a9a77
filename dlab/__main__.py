"""``python -m dlab ...``: the command line (``dlab.cli``)."""
import sys

from dlab.cli.main import main

sys.exit(main())
