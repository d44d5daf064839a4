"""Transformers' classes for a checkpoint: its config object (`transformers_config`, what the
layer-by-layer model and the proxy blocks are built from) and a whole model from local files
(`load_causal_lm`). A model type transformers has no classes for
(architectures.TRANSFORMERS_MODEL_TYPE: Kimi-K2) runs with the classes of the one it copies.
transformers is imported when one of them is called."""

from __future__ import annotations

import json
from pathlib import Path

from moe_proxy.architectures import TRANSFORMERS_MODEL_TYPE
from moe_proxy.errors import MoeProxyError


def transformers_config(config: dict):
    """The transformers config object of a checkpoint's `config.json` (as a dict)."""
    import transformers

    model_type = TRANSFORMERS_MODEL_TYPE.get(config.get("model_type"), config.get("model_type"))
    try:
        cls = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise MoeProxyError(f"transformers {transformers.__version__} has no model class for {model_type!r}") from None
    return cls.from_dict({**config, "model_type": model_type})


def load_causal_lm(path: str, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path)` (a local directory: storage.materialize.local_copy
    makes one of any store)."""
    from transformers import AutoModelForCausalLM

    config = json.loads(Path(path, "config.json").read_text())
    if config.get("model_type") in TRANSFORMERS_MODEL_TYPE:
        kwargs["config"] = transformers_config(config)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)
