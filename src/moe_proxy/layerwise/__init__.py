"""Running a checkpoint one decoder layer at a time, with transformers' own modules: the model
materialised layer by layer and the hidden states carried forward (`model`), transformers'
config and model classes for a checkpoint (`load`), the proxy's MoE block beside the
original's (`blocks`), and the one walk over the layers that every layer-by-layer pass runs
in (`driver`). Below `calibrate` and `build`, which hold the passes; torch and transformers."""
