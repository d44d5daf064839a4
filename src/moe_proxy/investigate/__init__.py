"""The investigation of a failure: the candidate fixes (`catalogue`), which of them cures it
(`diagnose`), where a run's failure began (`bisect`), and the recorded `moe-proxy` child
processes both run (`processes`: run records, reuse, interruption).

Sits on top of `moe_proxy.rl` and `moe_proxy.metrics`: the runs are child processes, so
nothing here imports torch."""
