"""Transformers' classes for a checkpoint: its config object (`transformers_config`, what the
layer-by-layer model and the proxy blocks are built from) and a whole model from local files
(`load_causal_lm`). A model type transformers has no classes for
(architectures.TRANSFORMERS_MODEL_TYPE: Kimi-K2) runs with the classes of the one it copies.
transformers is imported when one of them is called."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from moe_proxy.architectures import TRANSFORMERS_MODEL_TYPE
from moe_proxy.errors import MoeProxyError

log = logging.getLogger(__name__)


def transformers_config(config: dict):
    """The transformers config object of a checkpoint's `config.json` (as a dict)."""
    import transformers

    model_type = TRANSFORMERS_MODEL_TYPE.get(config.get("model_type"), config.get("model_type"))
    try:
        cls = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise MoeProxyError(f"transformers {transformers.__version__} has no model class for {model_type!r}") from None
    return cls.from_dict({**config, "model_type": model_type})


@functools.cache  # once per checkpoint (repro loads the policy and the reference)
def _say_mtp_left_out(path: str, layers: tuple[int, ...]) -> None:
    log.info("MTP layer%s %s left out of the model: an RL step neither samples nor trains with %s",
             "s" * (len(layers) > 1), ", ".join(map(str, layers)), "them" if len(layers) > 1 else "it")


def load_causal_lm(path: str, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path)` (a local directory: storage.materialize.local_copy
    makes one of any store). MTP layers (DeepSeek-V3's `num_nextn_predict_layers`, stored after
    the decoder's layers) have no module in transformers' model: they are left out, said once
    here, instead of transformers' load report listing each of their tensors as UNEXPECTED."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = json.loads(Path(path, "config.json").read_text())
    if config.get("model_type") in TRANSFORMERS_MODEL_TYPE:
        kwargs["config"] = transformers_config(config)
    mtp = config.get("num_nextn_predict_layers") or 0
    if not mtp:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    n = config["num_hidden_layers"]
    layers = list(range(n, n + mtp))
    _say_mtp_left_out(str(Path(path).resolve()), tuple(layers))
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(kwargs.get("config") or transformers_config(config))]
    ignore = [*(cls._keys_to_ignore_on_load_unexpected or []),
              rf"model\.layers\.({'|'.join(map(str, layers))})\..*"]
    return type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignore}).from_pretrained(path, **kwargs)
