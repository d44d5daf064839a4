"""moe-proxy: structure-preserving expert pruning of MoE LLM checkpoints.

A proxy keeps every layer, hidden size, attention block, router mechanism, shared expert and
the tokenizer of the original, and only fewer routed experts per MoE layer, so that RL
post-training failures of the original can be reproduced on a fraction of the accelerators.
"""

__version__ = "0.1.0"
