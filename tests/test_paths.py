from pathlib import Path

from backfill.paths import cache_root


def test_cache_root_is_the_env_var_or_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BACKFILL_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("BACKFILL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == Path(tmp_path) / ".cache" / "backfill"
