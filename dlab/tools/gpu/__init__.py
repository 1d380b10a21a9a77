"""The GPU half: ``python -m dlab gpu`` (``session``) spends a lent GPU's minutes on what the
CPU lab cannot measure and writes one folder under ``data/gpu/`` (``schema`` says what it holds);
``lessons`` shows that folder, labelled, wherever no GPU is present, and published figures
until one exists."""
