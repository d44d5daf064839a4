"""Reading a checkpoint: safetensors headers and byte ranges (`reader`), the one read path
(`reads`: coalesced ranged reads, read tasks, read-ahead), tensor roles per architecture
(`layout`), parameter counts (`params`), decoding stored tensors (`tensors`, torch), stored
tensors in transformers' module layout, whole or a rank's rows (`module_tensors`, torch),
`moe-proxy inspect` (`summary`) and finding checkpoints under a prefix (`listing`).
Torch-free but for `tensors` and `module_tensors`."""
