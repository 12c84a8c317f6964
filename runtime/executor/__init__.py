"""Executors: how a planned step runs on the device (runtime/engine.py's one step loop).

`serial.SerialExecutor` runs every step on the whole device (also the CPU), overlapped with
the host's planning of the next; `split.SplitExecutor` runs prefill and decode concurrently on
disjoint SM partitions (CUDA green contexts). Both implement `base.Executor`.
"""
