"""CPU time spent on this machine, from Linux's /proc: per Ray process, per process to the
nanosecond, and by all CPUs.

`stepserve profile` reads it around its live check (what the idle app burns, what the router
spends per step) for the simulator's shared-host model; the peer benchmark reports each
server's CPU with it. On a machine without /proc the readings are empty (and zero).
"""

from __future__ import annotations

import os


def ray_process_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (process title, CPU seconds so far) of every Ray process on this machine, not
    this one (a load generator or Ray's driver)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    pids = os.listdir("/proc") if os.path.isdir("/proc") else []
    for pid in pids:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if b"ray::" in cmdline or b"/ray/" in cmdline:
            out[int(pid)] = (process_title(cmdline), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def process_title(cmdline: bytes) -> str:
    """A Ray process's name: its actor (`ray::ServeReplica:stepserve:Router`, without the method
    it runs now) or its program (`raylet`, `log_monitor.py`)."""
    args = [arg.decode(errors="replace") for arg in cmdline.split(b"\0") if arg]
    name = next((arg for arg in args if arg.startswith("ray::") or "/ray/" in arg), args[0])
    return name.split(".", 1)[0].strip() if name.startswith("ray::") else name.rsplit("/", 1)[-1]


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds so far of the live threads of one process, to the nanosecond (the
    scheduler's own count, /proc/<pid>/task/*/schedstat, where /proc/<pid>/stat counts 10 ms
    ticks): for a long-lived actor, whose threads outlive what is measured. None once it is gone."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
    except OSError:
        return None
    return total / 1e9


def machine_busy_s() -> float:
    """Seconds all CPUs have been busy since boot (/proc/stat: every state but idle and iowait);
    0.0 without /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
