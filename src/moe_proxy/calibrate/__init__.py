"""Calibration: tokens (`tokens`), usage statistics per routed expert computed one decoder
layer at a time (`statistics`, a pass of moe_proxy.layerwise's driver), stored as an artifact
many builds reuse. Imports nothing of `build` but, when it runs, the sequential statistics'
selection (build.sequential)."""
