"""The store shared by the app's threads: closing it while another thread reads.

The app closes the service (and its store) on the engine thread while the store thread may
still be reading (the 2 s watch, a page of the list, a search). Closing a Python sqlite3
connection under a query another thread runs crashes the whole process (a segmentation
fault, seen in CI); the store must let the query finish and refuse later ones clearly.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

RACE = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from kvchat.errors import KvchatError
    from kvchat.store import Store

    home = Path(sys.argv[1])
    refusals = []
    for trial in range(int(sys.argv[2])):
        store = Store(home / f"kv{trial}.db")
        session = store.create_session("busy")
        for n in range(200):
            store.add_message(session.id, "user", f"message {n} " * 20)

        def read() -> None:
            try:
                while True:
                    store.messages(session.id)
                    store.search("message")
            except KvchatError as exc:
                refusals.append(str(exc))

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.002 * (trial % 5))
        store.close()
        store.close()  # twice: the second does nothing
        reader.join()
    print(len(refusals))
    print(refusals[0])
    """
)


def test_closing_the_store_under_another_threads_query_refuses_it_cleanly(tmp_path: Path):
    trials = 30
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", RACE, str(tmp_path), str(trials)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, first = done.stdout.splitlines()[:2]
    # Every reader ended on the store's own line, never a crash or a raw sqlite3 error.
    assert int(count) == trials
    assert "is closed" in first and "kv0.db" in first
