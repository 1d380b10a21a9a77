"""Tensor and sequence parallelism: dlab's Megatron-style ``tp`` (f / g operators, column and
row-parallel layers, vocabulary-parallel embedding and loss, sequence parallelism, TP x DP) and
PyTorch's ``parallelize_module`` on the same model as ``torch-tp``, its peer."""
