"""``python -m dlab.worker``: the program every rank runs, under ``dlab.launch``, torchrun or
Slurm. The command is kept at this path because cluster scripts name it; the program itself is
``dlab.runtime.worker``."""
from dlab.runtime.worker import main

if __name__ == "__main__":
    main()
