"""Reading CPU time from /proc: process titles, one process to the nanosecond, the machine's busy time."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from stepserve.host_cpu import machine_busy_s, process_cpu_s, process_title


def test_a_ray_process_is_named_by_its_actor_or_its_program():
    assert process_title(b"ray::ServeReplica:stepserve:Router.handle_request_with_rejection\0\0") == \
        "ray::ServeReplica:stepserve:Router"
    assert process_title(b"ray::IDLE\0") == "ray::IDLE"
    raylet = b"/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet\0--raylet_socket_name=x\0"
    assert process_title(raylet) == "raylet"
    assert process_title(b"/venv/bin/python\0-u\0/venv/lib/python3.11/site-packages/ray/_private/log_monitor.py\0") == \
        "log_monitor.py"


def test_a_process_cpu_time_counts_its_live_threads_to_the_nanosecond():
    # The child burns 0.3 s on a second thread, then both threads sleep (still alive).
    spin = ("import threading, time\ndone = threading.Event()\n"
            "def burn():\n    t = time.thread_time()\n    while time.thread_time() - t < 0.3: pass\n"
            "    done.set()\n    time.sleep(30)\n"
            "threading.Thread(target=burn, daemon=True).start()\ndone.wait()\n"
            "print('done', flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        cpu = process_cpu_s(child.pid)
        assert cpu is not None and 0.3 <= cpu < 0.3 + 2.0  # plus the interpreter's start
    finally:
        child.kill()
        child.wait()
    assert process_cpu_s(child.pid) is None  # gone


def test_the_machine_busy_time_counts_a_busy_child():
    before = machine_busy_s()
    started = time.monotonic()
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", busy], check=True)
    wall = time.monotonic() - started
    # The child burned 0.5 s of CPU; the machine was busy at least that long, at most wall x cores.
    assert 0.45 <= machine_busy_s() - before <= wall * os.cpu_count() + 0.1
