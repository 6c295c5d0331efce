"""The IO pools' worker setup never takes a pool down.

A ThreadPoolExecutor whose initializer raises refuses every later task (BrokenThreadPool). The
initializer only tunes torch's thread count, and torch is imported lazily (a codec imports it on
first use), so a worker can start while another thread is halfway through `import torch`. CI saw
`agentstate verify` die that way. These tests run that race in a fresh interpreter, where torch is
not imported yet, and check the tuning still reaches the workers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

RACE = textwrap.dedent(
    """
    import sys, threading
    assert "torch" not in sys.modules, "the race needs an interpreter that has not imported torch"
    from agentstate.backends.base import io_pool

    importer = threading.Thread(target=__import__, args=("torch",))
    importer.start()
    pools = during = 0
    while importer.is_alive() or during == 0:
        begun = "torch" in sys.modules  # the import has begun, so every worker of this pool starts after it
        pool = io_pool(2, "race")
        threads = [f.result() for f in [pool.submit(lambda: __import__("torch").get_num_threads()) for _ in range(4)]]
        pool.shutdown()
        if begun:  # each worker waited for the import to finish, then took one thread
            assert threads == [1] * 4, threads
            during += 1
        pools += 1
    importer.join()
    print("pools", pools, "after the import began", during)
    """
)


def test_a_worker_started_during_torchs_import_waits_for_it_and_the_pool_keeps_working() -> None:
    for _ in range(3):  # the window is the ~1 s torch takes to import; each run opens pools through it
        done = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("pools "), done.stdout


def test_a_failing_thread_knob_is_logged_and_the_pool_still_runs_tasks() -> None:
    """Whatever torch's setter does (a build without OpenMP raising, say), tasks still run."""
    script = textwrap.dedent(
        """
        import torch
        def refuse(n): raise RuntimeError("set_num_threads refused")
        torch.set_num_threads = refuse
        from agentstate.backends.base import io_pool
        pool = io_pool(2, "knob")
        print(sum(pool.submit(pow, 2, i).result() for i in range(8)))
        pool.shutdown()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "255"
    assert "keeps torch's default thread count" in done.stderr
