"""The multi-process supervisor: JAX's fatal abort on a dead peer becomes one line and exit 3.

The Watcher is run here on real child processes that print what JAX prints (absl records on
fd 2) and end as JAX ends them (SIGABRT); tests/test_multihost.py runs the real thing.
"""

import os
import subprocess
import sys

import pytest

from tp_jax.multihost.supervisor import EXIT_PEER_LOST, Watcher, describe

# What jaxlib 0.10.2 printed when a peer was SIGKILLed (heartbeat timeout) and when process 0 died.
HEARTBEAT_FATAL = """F1130 14:30:35.380716    7122 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. This most likely indicates that another task died; see the other task logs for more \
details. absl::Status: INTERNAL: Shutdown barrier has failed.
Barrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout. \
This indicates that the remote task has failed, got preempted, or crashed unexpectedly.
*** Check failure stack trace: ***
    @     0x7efc74840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""
UNHEALTHY_FATAL = """E1130 14:36:50.604073   10893 coordination_service.cc:1549] Use error polling to propagate the \
following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
2
F1130 14:36:50.604300   10900 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
2
The tasks have crashed.
"""
LEADER_FATAL = """F1130 14:30:40.516796    7593 client.h:80] Terminating process because the JAX distributed service \
detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. \
absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was \
preempted/died/restarted unexpectedly or this task is experiencing network issues.
"""


def test_describe_names_the_dead_process():
    assert describe(HEARTBEAT_FATAL, 0, 2, "127.0.0.1:5000", 10) == (
        "tp_jax: process 1 of 2 died or stopped responding (no heartbeat for 10 s); process 0 stops too (exit 3)")
    assert describe(UNHEALTHY_FATAL, 1, 3, None, 10).startswith("tp_jax: process 2 of 3 died or stopped responding")
    assert describe(LEADER_FATAL, 1, 2, "10.0.0.1:1234", 10) == (
        "tp_jax: process 0 of 2 (the coordinator at 10.0.0.1:1234) died or cannot be reached; process 1 stops "
        "too (exit 3)")
    other = describe("F0101 00:00:00.000000 1 client.h:80] ... fatal errors. absl::Status: INTERNAL: odd\nmore",
                     None, None, None, 10)
    assert other == "tp_jax: the job failed on another process (INTERNAL: odd); this process stops too (exit 3)"


def watch(child_code: str) -> tuple[int, str]:
    """Run `child_code` in a child whose stderr goes through a Watcher; (its code, what it relayed)."""
    child = subprocess.Popen([sys.executable, "-c", child_code], stderr=subprocess.PIPE)
    out_r, out_w = os.pipe()
    try:
        code = Watcher(child.pid, child.stderr.fileno(), lambda text: describe(text, 0, 2, None, 10),
                       out_fd=out_w).run()
    finally:
        os.close(out_w)
        child.stderr.close()
    with os.fdopen(out_r) as f:
        return code, f.read()


def writes(text: str) -> str:
    return f"import os, sys; os.write(2, {text.encode()!r}); "


def test_a_jax_fatal_abort_becomes_one_line_and_exit_3():
    code, relayed = watch(writes("[Gloo] Rank 0 is connected to 1 peer ranks.\n" + HEARTBEAT_FATAL) + "os.abort()")
    assert code == EXIT_PEER_LOST
    assert relayed.splitlines() == [
        "[Gloo] Rank 0 is connected to 1 peer ranks.",                  # native output that is not an error
        "tp_jax: process 1 of 2 died or stopped responding (no heartbeat for 10 s); process 0 stops too (exit 3)"]


def test_error_records_of_a_process_that_lives_on_are_relayed_and_its_code_kept():
    record = "E1130 14:37:48.908322   11629 preemption_sync_manager.cc:159] Failed to cancel preemption barrier\n"
    code, relayed = watch(writes("W1130 14:37:48.1 1 a.cc:1] careful\n" + record) + "sys.exit(5)")
    assert code == 5
    assert relayed == "W1130 14:37:48.1 1 a.cc:1] careful\n" + record


@pytest.mark.parametrize("how,code", [("os.abort()", -6), ("os.kill(os.getpid(), 9)", -9), ("sys.exit(0)", 0)])
def test_other_endings_are_passed_on(how, code):
    assert watch(writes("no newline at the end") + how) == (code, "no newline at the end")
