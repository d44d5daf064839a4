"""Calibration: tokens (`tokens`), usage statistics per routed expert computed one decoder
layer at a time (`statistics` over `layerwise`), stored as an artifact many builds reuse."""
