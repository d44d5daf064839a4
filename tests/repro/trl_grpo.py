"""A user's TRL run, as the tests and the operator's end-to-end test run it: TRL's GRPOTrainer
trains a tiny MoE checkpoint on CPU with `report_to=tensorboard` and moe-proxy's probes
callback, nothing else of moe-proxy's. Run as a script (the "framework" container of a
ProxyModel's template) or through `train()`.

    python tests/repro/trl_grpo.py [--model DIR] [--lr LR] [--steps N] [--beta B] [--nan-at STEP]

The model is `--model` or $MOEPROXY_PROXY_URI (what the operator gives the framework); the
TensorBoard events go where transformers puts them, $TENSORBOARD_LOGGING_DIR when set.
`--nan-at STEP` makes the run go non-finite: a NaN in one gradient element before the optimizer
step of STEP (a broken kernel's output), so the update makes that weight NaN; the next step's
sampling then fails on NaN probabilities and the run crashes, as real ones do.
"""

from __future__ import annotations

import argparse
import os
import sys


def char_tokenizer():
    """A character-level tokenizer (a-z, pad 0, eos 1) for the tiny model, which has no vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(97 + i): 2 + i for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def _nan_callback(step: int):
    import torch
    from transformers import TrainerCallback

    class NaNGradient(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == step:  # global_step counts the steps done before this update
                # a router's weight: every token passes it (an embedding row may be the padding's)
                grad = next(p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
                grad.view(-1)[0] = torch.nan

    return NaNGradient()


def train(model_dir: str, output_dir: str, *, lr: float = 1e-3, steps: int = 4, beta: float = 0.04,
          nan_at: int | None = None, seed: int = 0):
    """Train `steps` GRPO steps of the checkpoint at `model_dir`; returns the trainer."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from moe_proxy.probes import MoEProbeCallback

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    model.config.eos_token_id = model.generation_config.eos_token_id = 1
    args = GRPOConfig(output_dir=output_dir, use_cpu=True, report_to="tensorboard", max_steps=steps,
                      logging_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      learning_rate=lr, beta=beta, save_strategy="no", disable_tqdm=True, seed=seed)
    callbacks = [MoEProbeCallback()] + ([_nan_callback(nan_at)] if nan_at else [])
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "moe"] * 8}),
                          processing_class=char_tokenizer(), callbacks=callbacks)
    trainer.train()
    return trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("MOEPROXY_PROXY_URI"))
    p.add_argument("--out", default=os.environ.get("TRL_OUTPUT_DIR", "trl-run"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=int(os.environ.get("MOEPROXY_MAX_STEPS", "4")))
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--nan-at", type=int)
    p.add_argument("--seed", type=int, default=int(os.environ.get("MOEPROXY_SEED", "0")))
    args = p.parse_args(argv)
    if not args.model:
        print("trl_grpo: no --model and $MOEPROXY_PROXY_URI is not set", file=sys.stderr)
        return 2
    train(args.model, args.out, lr=args.lr, steps=args.steps, beta=args.beta, nan_at=args.nan_at, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
