"""Start `slipstream serve` (as `python -m slipstream.cli serve`) as a subprocess on a free
loopback port and stop it; every wait is bounded."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

READY = re.compile(r"ready on (http://127\.0\.0\.1:\d+)")
START_TIMEOUT = 240.0


class ServerProcess:
    def __init__(self, *flags: str, log_path: str | None = None):
        cmd = [sys.executable, "-m", "slipstream.cli", "serve", "--device", "cpu",
               "--host", "127.0.0.1", "--port", "0", *flags]
        self.log = open(log_path or os.devnull, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_ready()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            m = READY.search(line)
            if m:
                return m.group(1)
        self.kill()
        raise RuntimeError(f"the server did not start: {''.join(self.output)}")

    def wait_for_line(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if any(needle in x for x in self.output):
            return True
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                return False
            if needle in line:
                return True
        return False

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus text page (0.0 if absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (read from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out
