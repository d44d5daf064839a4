"""Calibration data: JSONL (text, prompt, verl chat prompt) and plain text, tokenised with the
checkpoint's own tokenizer (a real one, trained here with the `tokenizers` library)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_proxy.calibrate import statistics as cal
from moe_proxy.calibrate.tokens import calibration_tokens, read_documents
from moe_proxy.storage import LocalStore
from moe_proxy.demo.tiny import make_tiny

CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
WORDS = "the router sends each token to a few experts while shared experts see every token".split()


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint shipping a real BPE tokenizer (vocabulary < 256) and a chat template."""
    path = tmp_path_factory.mktemp("tok") / "qwen"
    make_tiny("qwen3_moe", path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT
    fast.save_pretrained(path)
    return path, fast


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_text_prompt_and_chat(with_tokenizer, tmp_path):
    path, tok = with_tokenizer
    chat = [{"role": "user", "content": "the router sends"}, {"role": "assistant", "content": "each token"}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "shared experts see every token"},
                                              {"prompt": "a few experts"}, {"prompt": chat}])
    docs = read_documents(str(data))
    assert docs[:2] == ["shared experts see every token", "a few experts"] and docs[2] == chat
    tokens = calibration_tokens(LocalStore(path), str(data), samples=2, seq_len=6, seed=0, vocab_size=256)
    assert not tokens.random and "checkpoint's tokenizer" in tokens.origin
    want = []
    for text in ("shared experts see every token", "a few experts", tok.apply_chat_template(chat, tokenize=False)):
        want += tok(text)["input_ids"] + [tok.eos_token_id]
    assert tokens.ids.flatten().tolist() == want[:12]
    assert "<|user|>" in tok.apply_chat_template(chat, tokenize=False)  # the chat template was applied


def test_plain_text_calibration_end_to_end(with_tokenizer, tmp_path):
    path, tok = with_tokenizer
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    summary = cal.calibrate(str(path), str(tmp_path / "s"), dataset=str(data), samples=4, seq_len=16)
    assert summary["tokens"]["random"] is False and str(data) in summary["tokens"]["origin"]
    stats = cal.load(str(tmp_path / "s"))
    assert int(stats.token_ids.max()) < len(tok)


def test_changed_dataset_is_recalibrated(with_tokenizer, tmp_path):
    path, _ = with_tokenizer
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": " ".join(WORDS)}] * 4)
    first = cal.calibrate(str(path), str(tmp_path / "s"), dataset=str(data), samples=2, seq_len=8)
    assert cal.calibrate(str(path), str(tmp_path / "s"), dataset=str(data), samples=2, seq_len=8).get("up_to_date")
    write_jsonl(data, [{"text": " ".join(reversed(WORDS))}] * 4)  # same file, other text
    again = cal.calibrate(str(path), str(tmp_path / "s"), dataset=str(data), samples=2, seq_len=8)
    assert not again.get("up_to_date") and again["tokens"]["sha256"] != first["tokens"]["sha256"]
    want = calibration_tokens(LocalStore(path), str(data), samples=2, seq_len=8, seed=0, vocab_size=256).ids
    assert torch.equal(cal.load(str(tmp_path / "s")).token_ids, want)


def test_short_dataset_gives_fewer_samples(with_tokenizer, tmp_path, caplog):
    path, _ = with_tokenizer
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a few experts"}] * 3)
    tokens = calibration_tokens(LocalStore(path), str(data), samples=50, seq_len=4, seed=0, vocab_size=256)
    assert 1 <= tokens.ids.shape[0] < 50 and "instead of 50" in caplog.text


def test_without_tokenizer_random_ids_said_plainly(tmp_path):
    make_tiny("qwen3_moe", tmp_path / "q")  # ships no tokenizer
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    tokens = calibration_tokens(LocalStore(tmp_path / "q"), str(data), samples=2, seq_len=4, seed=3, vocab_size=256)
    assert tokens.random and "no usable tokenizer" in tokens.origin
    again = calibration_tokens(LocalStore(tmp_path / "q"), None, samples=2, seq_len=4, seed=3, vocab_size=256)
    assert torch.equal(tokens.ids, again.ids)  # seeded: the same ids every time


def test_parquet_needs_pyarrow_or_reads_verl_rows(with_tokenizer, tmp_path):
    path, _ = with_tokenizer
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        from moe_proxy.calibrate.tokens import BadDataset

        with pytest.raises(BadDataset, match="needs pyarrow"):
            read_documents(str(tmp_path / "d.parquet"))
        return
    chat = [{"role": "user", "content": "the router"}]
    pq.write_table(pa.table({"prompt": [chat, chat], "data_source": ["x", "y"]}), tmp_path / "d.parquet")
    assert read_documents(str(tmp_path / "d.parquet")) == [chat, chat]
