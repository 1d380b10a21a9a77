"""Every checked exercise, registered on import (``check`` imports this)."""
from dlab.exercises import distributed, local  # noqa: F401
