import pytest

from bench_helpers import BPETokenizer


@pytest.fixture(scope="session")
def bpe() -> BPETokenizer:
    return BPETokenizer()
