"""Calibration: tokens (`tokens`), usage statistics per routed expert computed one decoder
layer at a time (`statistics`, a pass of moe_proxy.layerwise's driver), stored as an artifact
many builds reuse, and the criteria they are judged by (`criteria`: dead and super experts).
Imports nothing of `pruning` but, when it runs, the sequential statistics' selection
(pruning.sequential)."""
