"""Pipeline parallelism: the model cut into stages by layers, micro-batches flowing through them
on a schedule written as data (naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V).

``dlab.layout.schedules`` writes each rank's action list, ``dlab.theory.simulate`` runs it on
paper, ``executor`` runs it on real ranks, ``split`` cuts the model into stages,
``weight_grad`` splits a backward, ``torch_pipelining`` runs PyTorch's own schedules on the
same stages. The ``pipeline-*`` strategies are ``nd``'s presets (``dlab.parallel.nd.pipelines``).
"""
