"""The systems the benchmark compares, each run as its own multi-process job (``python -m bench.baselines.job``).

``workload``: the model, data, initial weights and optimizer every system gets; ``job``: the entry point run in
subprocesses; ``slidedp``/``ddp`` (Lightning), ``fsdp2``/``zero_offload`` (plain torch / DeepSpeed loops);
``runner``: the parent side (timeout, host-memory sampling, results); ``hostmem``: the sampler.
"""
