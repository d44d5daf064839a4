"""Calibration data: JSONL (text, prompt, verl chat prompt), parquet in verl's schema and plain text, tokenised with the
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


def test_without_tokenizer_the_text_is_read_as_bytes_as_repro_feeds_it(tmp_path):
    make_tiny("qwen3_moe", tmp_path / "q")  # ships no tokenizer, a vocabulary of 256
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello é"}, {"text": "1+2="}])
    tokens = calibration_tokens(LocalStore(tmp_path / "q"), str(data), samples=1, seq_len=12, seed=3, vocab_size=256)
    assert not tokens.random and "read as bytes" in tokens.origin
    # the UTF-8 bytes, each document ended by a newline (repro's byte codec ends an answer there)
    assert tokens.ids[0].tolist() == list("hello é\n1+2".encode())  # 12 of the 14 bytes


def test_without_tokenizer_or_byte_vocabulary_random_ids_said_plainly(tmp_path):
    make_tiny("qwen3_moe", tmp_path / "q")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    tokens = calibration_tokens(LocalStore(tmp_path / "q"), str(data), samples=2, seq_len=4, seed=3, vocab_size=200)
    assert tokens.random and "no usable tokenizer" in tokens.origin and "200 < 256" in tokens.origin
    again = calibration_tokens(LocalStore(tmp_path / "q"), None, samples=2, seq_len=4, seed=3, vocab_size=200)
    assert torch.equal(tokens.ids, again.ids)  # seeded: the same ids every time


def test_a_tokenizer_that_cannot_load_is_not_read_as_bytes(tmp_path):
    make_tiny("qwen3_moe", tmp_path / "q")
    (tmp_path / "q" / "tokenizer.json").write_text("{not a tokenizer")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    tokens = calibration_tokens(LocalStore(tmp_path / "q"), str(data), samples=2, seq_len=4, seed=3, vocab_size=256)
    assert tokens.random and "could not be loaded" in tokens.origin


def verl_rows(questions):
    """Rows in verl's dataset schema (its examples/data_preprocess scripts, e.g. gsm8k.py)."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}
            for i, q in enumerate(questions)]


def test_parquet_in_verl_schema(with_tokenizer, tmp_path):
    """A real parquet file written by pyarrow (a dependency of the `hf` and `test` extras), the
    chat `prompt` a list<struct<role, content>> column: rendered with the chat template, end to end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tok = with_tokenizer
    questions = ["the router sends each token", "shared experts see every token", "a few experts"]
    table = pa.Table.from_pylist(verl_rows(questions))
    assert table.schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(table, tmp_path / "train.parquet")
    chats = [[{"role": "user", "content": q}] for q in questions]
    assert read_documents(str(tmp_path / "train.parquet")) == chats
    tokens = calibration_tokens(LocalStore(path), str(tmp_path / "train.parquet"), samples=2, seq_len=5, seed=0,
                                vocab_size=256)
    want = [t for chat in chats for t in tok(tok.apply_chat_template(chat, tokenize=False))["input_ids"] + [tok.eos_token_id]]
    assert not tokens.random and tokens.ids.flatten().tolist() == want[:10]
    summary = cal.calibrate(str(path), str(tmp_path / "s"), dataset=str(tmp_path / "train.parquet"), samples=2, seq_len=5)
    assert summary["tokens"]["random"] is False and "train.parquet, 3 documents" in summary["tokens"]["origin"]


def test_parquet_broken_or_without_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moe_proxy.errors import BadDataset

    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(BadDataset, match="broken.parquet: not a readable parquet file"):
        read_documents(str(tmp_path / "broken.parquet"))
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "qa.parquet")
    with pytest.raises(BadDataset, match=r"qa.parquet, row 0: no usable 'text'.*fields present: \['answer', 'question'\]"):
        read_documents(str(tmp_path / "qa.parquet"))
