import httpx
import pytest

from backfill.bench.server_process import served
from backfill.errors import BackfillError


def test_served_runs_the_server_on_loopback_until_the_block_ends():
    with served(["--tiny", "--log-level", "warning"], health_timeout_s=120.0) as url:
        assert url.startswith("http://127.0.0.1:")
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"]
    with pytest.raises(httpx.HTTPError):   # stopped: nothing listens there any more
        httpx.get(f"{url}/health", timeout=2)


def test_a_server_that_exits_at_start_is_a_typed_error():
    with pytest.raises(BackfillError, match="exited with code 2 before it was healthy"):
        with served(["--tiny", "--max-online-queue", "0"], health_timeout_s=60.0):
            pass
