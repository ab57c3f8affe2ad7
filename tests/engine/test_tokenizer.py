import random
import re
import unicodedata

import pytest
from test_weights import CHATML, MERGES, SPECIALS, tiny_vocab

from backfill.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from backfill.errors import InvalidRequestError, ModelLoadError

TEXTS = ["Hello world", "  leading spaces", "trailing   ", "a 123 b 4567890 c 3.14159", "1,000,000.50 $3.14",
         "ñandú café naïve Ünïcödé", "你好，世界！こんにちは 안녕하세요", "emoji 🎉🚀👩‍👩‍👧 flags 🇫🇷", "",
         "def f(x):\n    return x ** 2\n\n\n", "tabs\tand\r\nCRLF\n", "It's we'll they've I'm he'd",
         "   \n\n  \t ", "<|im_start|>user\nhi<|im_end|>", "x" * 300, "mixed: αβγ 123abc ABC_def-ghi",
         "```python\nimport os\nprint(os.getcwd())\n```", "<b>html</b> &amp; {json: [1, 2]}"]


def tiny_tokenizer(chat_template: str | None = CHATML, add_bos: bool = False, pre: str = "smollm") -> Tokenizer:
    vocab = tiny_vocab()
    return Tokenizer.from_gguf_vocab(tokens=vocab, merges=MERGES,
                                     token_types=[3 if t in SPECIALS else 1 for t in vocab], pre_type=pre,
                                     bos_token_id=1, eos_token_id=2, add_bos_token=add_bos,
                                     chat_template=chat_template)


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pools = ["abcxyz ABC", "0123456789", " \t\n", ".,;:!?'\"()[]{}", "éßøñü", "你好世界", "🎉🚀", "ÀΩЖ"]
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def test_byte_level_roundtrip_and_merges():
    tok = tiny_tokenizer()
    assert tok.vocab_size == len(tiny_vocab())
    assert tok.encode(" the") == [tiny_vocab().index("Ġthe")]
    for text in TEXTS + random_texts(50):
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_match_whole_and_are_skipped_on_decode():
    tok = tiny_tokenizer()
    ids = tok.encode("<|im_start|>user the<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user the"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user the<|im_end|>"
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.token_to_id("<|im_end|>") == 2
    assert tok.stop_token_ids == (2, 0)  # eos (<|im_end|>) and <|endoftext|>
    assert tok.token_to_id("not-a-token") is None


def test_add_special_tokens_prepends_bos_only_when_configured():
    assert tiny_tokenizer(add_bos=True).encode("hi", add_special_tokens=True)[0] == 1
    assert tiny_tokenizer(add_bos=True).encode("hi")[0] != 1
    assert tiny_tokenizer(add_bos=False).encode("hi", add_special_tokens=True)[0] != 1


def test_chat_template_renders_and_encodes():
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "the"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1


@pytest.mark.parametrize("messages", [[], "hi", [["user", "hi"]], [{"role": "user"}], [{"role": 1, "content": "x"}],
                                      [{"role": "user", "content": None}]])
def test_invalid_messages(messages):
    with pytest.raises(InvalidRequestError):
        tiny_tokenizer().apply_chat_template(messages)


def test_template_raise_exception_and_missing_template():
    with pytest.raises(InvalidRequestError, match="bad role"):
        tiny_tokenizer().apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tiny_tokenizer(chat_template=None).encode_chat([{"role": "user", "content": "x"}])


def test_template_is_sandboxed():
    tok = tiny_tokenizer(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_unknown_pre_tokenizer_is_rejected():
    with pytest.raises(ModelLoadError, match="pre-type"):
        tiny_tokenizer(pre="some-future-model")


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_detokenizer_holds_back_split_characters(chunk):
    tok = tiny_tokenizer()
    for text in TEXTS + random_texts(30, seed=1):
        ids = tok.encode(text)
        deltas = stream(tok, ids, prompt=tok.encode("the prompt"), chunk=chunk)
        assert "".join(deltas) == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_emits_nothing_for_a_partial_character():
    tok = tiny_tokenizer()
    ids = tok.encode("你")  # one character, three byte tokens
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "", "你"]


def test_incremental_detokenizer_flushes_an_unfinished_character():
    tok = tiny_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("a") + tok.encode("你")[:1]) == ""
    assert detok.flush() == "a\ufffd"


@pytest.fixture(scope="module")
def real_tokenizers():
    from transformers import AutoTokenizer

    from backfill.engine.default_model import default_model_path
    from backfill.engine.gguf_reader import read_gguf

    path = default_model_path()
    _, _, ours = read_gguf(path)
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def split_digits(text: str) -> list[str]:
    """llama.cpp's first 'smollm' pre-tokenizer pass: every \\p{N} character is its own piece."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch] if current else [ch]
            current = ""
        else:
            current += ch
    return pieces + ([current] if current else [])


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_tokenizers):
    """transformers' GGUF loader ignores tokenizer.ggml.pre == "smollm" and so does not isolate
    digits first; it differs from llama.cpp (and SmolLM2's own tokenizer.json) only where
    whitespace precedes a digit. We follow llama.cpp: equal to transformers on every piece."""
    ours, reference = real_tokenizers
    assert ours.vocab_size == 49152 and ours.eos_token_id == 2 and ours.bos_token_id == 1
    assert ours.stop_token_ids == (2, 0)
    for text in TEXTS + random_texts(300, seed=2):
        want = [i for piece in split_digits(text) for i in reference.encode(piece, add_special_tokens=False)]
        assert ours.encode(text) == want, text
        if not re.search(r"\s\d", text):
            assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert "".join(stream(ours, ids)) == ours.decode(ids)


@pytest.mark.slow
def test_real_chat_template_matches_transformers(real_tokenizers):
    ours, reference = real_tokenizers
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 👋"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
        want_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
        assert ours.encode_chat(messages) == list(want_ids)


def test_lone_surrogate_is_a_typed_error():
    from backfill.engine.byte_tokenizer import ByteTokenizer
    from backfill.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        ByteTokenizer().encode("bad \ud800 text")
