"""The torch thread: one thread builds and runs the model; a busy thread never deadlocks a caller."""

import threading

from backfill.serving.torch_thread import on_torch_thread, run_on_torch_thread, start_on_torch_thread


def test_work_runs_on_one_long_lived_thread():
    first = run_on_torch_thread(threading.get_ident)
    assert run_on_torch_thread(threading.get_ident) == first != threading.get_ident()
    assert run_on_torch_thread(on_torch_thread) and not on_torch_thread()
    # Nested calls run inline instead of waiting for themselves.
    assert run_on_torch_thread(lambda: run_on_torch_thread(threading.get_ident)) == first


def test_a_running_loop_neither_blocks_other_work_nor_a_second_loop():
    torch_thread = run_on_torch_thread(threading.get_ident)
    release, seen = threading.Event(), {}

    def loop(name):
        def run():
            seen[name] = threading.get_ident()
            release.wait(10)
        return run

    first = start_on_torch_thread(loop("first"))
    second = start_on_torch_thread(loop("second"))
    # While the first loop holds the torch thread, work runs inline in the caller.
    assert run_on_torch_thread(threading.get_ident) == threading.get_ident()
    release.set()
    first.result(10)
    second.result(10)
    assert seen["first"] == torch_thread and seen["second"] != torch_thread
    assert run_on_torch_thread(threading.get_ident) == torch_thread  # free again once the loop ended


def test_glibc_is_told_to_keep_freed_memory_for_reuse():
    """Under glibc the settings are taken (mallopt answers 1 for each); elsewhere nothing is set."""
    import platform

    from backfill.serving import torch_thread

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert torch_thread.keep_freed_memory_for_reuse() is glibc
