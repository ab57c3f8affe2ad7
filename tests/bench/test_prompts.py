import pytest

from backfill.bench.prompts import PromptSource, bundled_corpus
from backfill.engine.byte_tokenizer import ByteTokenizer
from backfill.errors import WorkloadError

from bench_helpers import WhitespaceTokenizer


def test_bundled_corpus_is_a_few_kb():
    assert 3_000 < len(bundled_corpus().encode()) < 20_000


@pytest.mark.parametrize("n", [1, 2, 7, 64, 333, 2048])
def test_exact_token_counts_with_bpe(bpe, n):
    src = PromptSource(bpe, seed=3)
    for i in range(10):
        p = src.prompt(i, n)
        assert len(p.token_ids) == n
        assert p.text_exact
        assert bpe.encode(p.text) == list(p.token_ids)


@pytest.mark.parametrize("tok", [WhitespaceTokenizer(), ByteTokenizer()])
def test_exact_token_counts_with_other_tokenizers(tok):
    src = PromptSource(tok, seed=0)
    for i, n in enumerate([1, 5, 100, 900]):
        p = src.prompt(i, n)
        assert len(p.token_ids) == n and tok.encode(p.text) == list(p.token_ids)


def test_deterministic_per_seed_and_index(bpe):
    a, b = PromptSource(bpe, seed=1), PromptSource(bpe, seed=1)
    assert a.prompt(5, 100) == b.prompt(5, 100)
    assert a.prompt(5, 100) == a.prompt(5, 100)
    assert PromptSource(bpe, seed=2).prompt(5, 100).text != a.prompt(5, 100).text


def test_no_shared_prefixes_between_requests(bpe):
    src = PromptSource(bpe, seed=0)
    prompts = [src.prompt(i, 64).token_ids for i in range(200)]
    # No two prompts share even their first 8 tokens, so no prefix-cache block is shared by accident.
    assert len({p[:8] for p in prompts}) == 200
    bodies = {src.prompt(i, 300).text.split(". ", 1)[1][:40] for i in range(50)}
    assert len(bodies) > 40  # different offsets into the text, not just different tags


def test_bad_arguments(bpe):
    src = PromptSource(bpe)
    with pytest.raises(WorkloadError):
        src.prompt(0, 0)
    with pytest.raises(WorkloadError):
        src.prompt(-1, 5)
    with pytest.raises(WorkloadError, match="corpus"):
        PromptSource(bpe, corpus="tiny")
    with pytest.raises(WorkloadError):
        PromptSource(bpe, seed=-1)
