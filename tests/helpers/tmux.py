"""A command in a detached tmux session of a fixed size, read back as the screen shows it
(`kvpipe top`'s test). Each `Tmux` runs its own tmux server (`-L` a socket of its own), which
`close()` kills with its sessions; the pane outlives the command so a failure stays on screen."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Sequence

ENV_PASSED = ("PYTHONPATH", "KVPIPE_API_KEY")  # what the command needs of ours (tmux keeps its own)


def have_tmux() -> bool:
    return shutil.which("tmux") is not None


class Tmux:
    def __init__(self, cols: int = 200, rows: int = 40) -> None:
        self.cols, self.rows = cols, rows
        self.base = ["tmux", "-L", f"kvpipe-test-{uuid.uuid4().hex[:8]}"]
        self.started = False
        self.session = "s"

    def start(self, argv: Sequence[str], session: str = "s") -> None:
        env = [f"-e{k}={os.environ[k]}" for k in ENV_PASSED if k in os.environ]
        # the pane's size: a COLUMNS / LINES inherited from our environment would win over it
        env += [f"-eCOLUMNS={self.cols}", f"-eLINES={self.rows}"]
        shell = f"{shlex.join(argv)}; sleep 600"  # killed with the server
        size = ["-x", str(self.cols), "-y", str(self.rows)]
        subprocess.run([*self.base, "new-session", "-d", "-s", session, *size, *env, shell], check=True, timeout=30)
        self.started = True
        self.session = session

    def screen(self) -> str:
        r = subprocess.run(
            [*self.base, "capture-pane", "-p", "-t", self.session], capture_output=True, text=True, timeout=30
        )
        return r.stdout

    def close(self) -> None:
        if self.started:
            subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)
            self.started = False
