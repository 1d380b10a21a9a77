"""The program every rank of a training run runs, under ``dlab.launch``, torchrun or Slurm:
``python -m dlab.worker`` (``main``: the rank's life, from the process group to its report),
the one training loop (``train``), and the checks a config passes first (``validate``)."""
