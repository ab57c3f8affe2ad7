"""The build lock: a killed build never leaves later model loads waiting forever."""

import subprocess
import sys
import threading

from torch.utils import cpp_extension

from backfill.engine import native_build
from backfill.engine.native_build import exclusive_build


def test_a_stale_torch_lock_file_is_cleared(tmp_path):
    (tmp_path / "lock").write_text("")  # what a build killed inside torch's baton leaves behind
    with exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_lock_dies_with_a_killed_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from backfill.engine.native_build import exclusive_build\n"
         "with exclusive_build(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build() -> None:
            with exclusive_build(tmp_path):
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(0.5), "a second builder must wait while the first holds the lock"
        holder.kill()
        assert entered.wait(10), "the lock must be released when its holder is killed"
    finally:
        holder.kill()
        holder.wait()


def test_two_checkouts_of_one_source_compile_the_same_cached_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / "cache" / name))
    compiled = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: compiled.append(kw["sources"]))
    sources = []
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        sources.append(tmp_path / checkout / "k.cpp")
        sources[-1].write_text("int x;\n")
    native_build.build_cpu_extension("k", sources[0])
    copy = compiled[0][0]
    stamp = (tmp_path / "cache").glob("*/k.cpp").__next__().stat().st_mtime_ns
    native_build.build_cpu_extension("k", sources[1])
    assert compiled[1] == [copy] and str(tmp_path / "cache") in copy
    assert next((tmp_path / "cache").glob("*/k.cpp")).stat().st_mtime_ns == stamp   # not rewritten: no rebuild
    sources[1].write_text("int y;\n")
    native_build.build_cpu_extension("k", sources[1])
    assert open(copy).read() == "int y;\n"


def test_the_kernels_build_where_a_compiler_is_present():
    """The kernels' tests skip where no kernel loads, so a source that stops compiling must fail here
    instead (where there is a C++ compiler: CI's machines have one)."""
    import shutil

    import pytest

    from backfill.engine import paged_attention

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    assert paged_attention.load_paged_decode_attention() is not None
    assert paged_attention.load_paged_prompt_attention() is not None
