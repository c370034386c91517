"""Saved chats survive a killed server: a subprocess saves chats through the UI's real storage
(serving.sessions.UserData, as the Chat tab does after every reply) in a tight loop and is
killed with SIGKILL at random moments, mid-save; every chat on disk then loads whole, holding
at least every turn the writer had reported saved, and the next writer carries on."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serving.sessions import UserData

ROOT = Path(__file__).resolve().parents[2]
CHATS = ("alpha", "beta", "gamma")

# Round r rewrites every chat with turns 0..start+r (big ones, so that a kill often lands
# inside a write), then prints r: everything up to round r is on disk.
WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from serving.sessions import UserData

    data = UserData(Path(sys.argv[2]))
    start = int(sys.argv[3])
    for r in range(10**6):
        turns = start + r + 1
        for name in {chats!r}:
            messages = [
                {{"role": "user" if t % 2 == 0 else "assistant",
                  "content": f"{{name}} turn {{t}} " + "x" * 20000}}
                for t in range(turns)
            ]
            data.save_chat(name, messages, system_prompt=f"{{name}} system")
        print(turns, flush=True)
    """
).format(chats=CHATS)


def _start_writer(root: Path, start: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(ROOT), str(root), str(start)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _check_chats(data: UserData, at_least: int) -> int:
    """Every chat loads whole with turns 0..n-1 for one n >= at_least; returns the least n."""
    assert sorted(data.chat_names()) == sorted(CHATS)
    least = None
    for name in CHATS:
        messages, system = data.load_chat(name)
        assert system == f"{name} system"
        assert len(messages) >= at_least, (name, len(messages), at_least)
        for t, message in enumerate(messages):
            assert message["content"].startswith(f"{name} turn {t} ")
            assert len(message["content"]) == len(f"{name} turn {t} ") + 20000
        least = len(messages) if least is None else min(least, len(messages))
    return least or 0


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_mid_save_leaves_every_chat_whole(tmp_path: Path) -> None:
    rng = random.Random(1)
    data = UserData(tmp_path)
    saved = 0  # turns every chat had on disk when the last writer was killed
    for kill in range(6):
        writer = _start_writer(tmp_path, saved)
        reported = saved
        try:
            # Let it complete a few rounds, then kill it at a random moment of a later one.
            for _ in range(rng.randint(1, 4)):
                line = writer.stdout.readline()
                assert line, f"writer {kill} ended early (status {writer.poll()})"
                reported = int(line)
            time.sleep(rng.uniform(0, 0.05))
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(10)
            writer.stdout.close()
        assert writer.returncode == -signal.SIGKILL
        # "Restart": a fresh UserData reads what the killed process left.
        saved = _check_chats(UserData(tmp_path), reported)
        assert saved >= reported
    # A kill between mkstemp and os.replace can leave a hidden temporary file: never a chat.
    leftovers = [p.name for p in (tmp_path / "chats").iterdir() if p.suffix == ".tmp"]
    assert all(name.startswith(".") for name in leftovers)
    assert data.chat_names() and all(not n.startswith(".") for n in data.chat_names())
