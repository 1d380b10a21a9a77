"""The strategy registry reads its names from the sources and imports one module per ``get``:
what it reads must be what importing registers, and a run must not import the others."""
import importlib
import pkgutil
import subprocess
import sys

import pytest

from dlab import parallel


def test_the_names_read_from_the_sources_are_the_names_importing_registers():
    for module in pkgutil.walk_packages(parallel.__path__, prefix="dlab.parallel."):
        importlib.import_module(module.name)
    registered = {name: cls.__module__ for name, cls in parallel._REGISTRY.items()}
    assert registered == parallel.declared()


def test_getting_a_strategy_imports_its_module_and_not_the_others():
    code = ("import sys\nfrom dlab import parallel\nparallel.get('ddp')\n"
            "print(sorted(m for m in sys.modules if m.startswith('dlab.parallel.') and "
            "m in set(parallel.declared().values())))\n"
            "print('torch.distributed.pipelining' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules, pipelining = out.stdout.splitlines()
    assert modules == "['dlab.parallel.data_parallel.ddp']"
    assert pipelining == "False"


def test_an_unknown_strategy_names_the_known_ones_and_the_closest():
    with pytest.raises(ValueError, match=r"no strategy 'zer3'\. Did you mean 'zero3'\?.*ddp"):
        parallel.get("zer3")
