"""Many hosts, on one machine: 2 real processes x 4 simulated CPU devices (scripts/launch.py).

One launch of tests/multihost_worker.py covers the tiny model: greedy tokens at tp=4,
dp=2 x tp=4 and pp=2 x tp=4 equal one process with 8 devices and transformers; each
process's loader reads only its own devices' blocks; tp groups spanning processes and
disagreeing arguments are refused; then a rank is killed mid-generation and the launcher must stop the job. Other
tests: the launcher alone, a wrong coordinator address, mismatched process counts, SmolLM2; and two
scripts/generate.py processes started by hand (no launcher): pure JSON on stdout, and a peer killed or frozen
mid-run ends the survivor with one line and exit code 3.
"""

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.tiny_models import hf_greedy, make_checkpoint, make_tokenized_checkpoint
from tp_jax.multihost.launcher import free_port, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "scripts", "launch.py")
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
GENERATE = os.path.join(ROOT, "scripts", "generate.py")
PROMPTS = [[5, 17, 300, 42, 9], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 200, 300], [999, 3]]
RUNS = {"tp8": {"tp": 8, "dp": 1}, "disagree": {"tp": 4, "dp": 1, "rank1_tp": 2},
        "tp4": {"tp": 4, "dp": 1}, "pp2tp4": {"tp": 4, "dp": 1, "pp": 2},
        "dp2tp4": {"tp": 4, "dp": 2}}                   # the last one runs on, until a rank is killed
ENV = dict(os.environ, TP_JAX_INIT_TIMEOUT="60", TP_JAX_HEARTBEAT_TIMEOUT="20")


def launch_cmd(*program, timeout=200):
    return [sys.executable, LAUNCH, "--num-processes", "2", "--devices-per-process", "4",
            "--timeout", str(timeout), "--", *program]


def start(cmd, env=ENV) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def rank_of(line: str) -> int:
    return int(line.split("[rank ", 1)[1].split("]", 1)[0])


def count_reads(monkeypatch) -> list:
    """Bytes returned by safetensors slice reads (= bytes read from the checkpoint), in a list cell."""
    from tp_jax.loaders import safetensors as st
    counter, getitem = [0], st.SafetensorsTensor.__getitem__

    def counting(self, index):
        arr = getitem(self, index)
        counter[0] += arr.nbytes
        return arr
    monkeypatch.setattr(st.SafetensorsTensor, "__getitem__", counting)
    return counter


def one_process_refs(path: str) -> dict:
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    ref = {"hf": [hf_greedy(path, p, 12) for p in PROMPTS]}
    with pytest.MonkeyPatch.context() as mp:
        reads = count_reads(mp)
        for tp, dp in ((4, 1), (4, 2)):
            reads[0] = 0
            llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, progress=False)
            ref["reads", tp, dp] = reads[0]
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
            ref["tokens", tp, dp] = [o.outputs[0].token_ids for o in outs]
        ref["logits"] = llm.get_logits([PROMPTS[0]])
    return ref


def run_then_kill_rank1(proc: subprocess.Popen) -> dict:
    """Read RESULT lines until both ranks are READY (generating on), SIGKILL rank 1, time the exit."""
    lines, results, pids = queue.Queue(), {}, {}
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    while len(pids) < 2:
        line = lines.get(timeout=240)
        if "] RESULT " in line:
            r = json.loads(line.split("] RESULT ", 1)[1])
            results[r["rank"], list(RUNS)[r["run"]]] = r
        elif "] READY " in line:
            pids[rank_of(line)] = int(line.split("READY ")[1])
    time.sleep(1.0)                              # well inside the next generate
    t = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code = proc.wait(timeout=90)
    return {"results": results, "pids": pids, "code": code, "exit_s": time.monotonic() - t,
            "stderr": proc.stderr.read()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """References from this process and the 2-process launch (started first: it runs meanwhile)."""
    path = make_checkpoint("gqa", str(tmp_path_factory.mktemp("multihost")))
    req = {"prompts": PROMPTS, "max_tokens": 12, "runs": list(RUNS.values()), "logits": [PROMPTS[0]], "loop": True}
    t = time.monotonic()
    proc = start(launch_cmd(WORKER, path, json.dumps(req), timeout=300))
    try:
        ref = one_process_refs(path)
        launched = run_then_kill_rank1(proc)
    finally:
        proc.kill()
    print(f"references, 2 processes x {len(RUNS)} runs, kill: {time.monotonic() - t:.1f}s")
    return {**ref, **launched}


def test_tp4_dp2tp4_pp2tp4_on_two_processes_equal_one_process_and_transformers(tiny):
    res = tiny["results"]
    for run, (tp, dp) in (("tp4", (4, 1)), ("dp2tp4", (4, 2))):
        assert res[0, run]["tokens"] == tiny["tokens", tp, dp] == tiny["hf"], run
        assert res[1, run]["tokens"] == []                        # only the driver returns outputs
    assert res[0, "pp2tp4"]["tokens"] == tiny["hf"] and res[1, "pp2tp4"]["tokens"] == []
    for rank in (0, 1):                                           # get_logits: gathered on every process
        np.testing.assert_allclose(np.array(res[rank, "dp2tp4"]["logits"]), tiny["logits"], atol=1e-5)


def test_each_process_reads_only_its_own_devices_blocks(tiny):
    """A full replica (one tp group of 4 devices) costs what one process with 4 devices reads."""
    res, replica = tiny["results"], tiny["reads", 4, 1]
    # one process, 8 devices, two replicas: each block is read once and copied device to device
    assert replica > 0 and tiny["reads", 4, 2] == replica
    # dp=1 x tp=4: the mesh is process 0's 4 devices; process 1 holds none and reads nothing
    assert (res[0, "tp4"]["bytes_read"], res[1, "tp4"]["bytes_read"]) == (replica, 0)
    # dp=2 x tp=4: each process holds one replica and reads exactly it, not the other's
    assert (res[0, "dp2tp4"]["bytes_read"], res[1, "dp2tp4"]["bytes_read"]) == (replica, replica)
    # pp=2 x tp=4: each process holds one stage: only its layer (2 layers), less than a replica
    assert (res[0, "pp2tp4"]["layers_read"], res[1, "pp2tp4"]["layers_read"]) == ([0], [1])
    assert all(0 < res[r, "pp2tp4"]["bytes_read"] < replica for r in (0, 1))


def test_tp_across_processes_and_disagreeing_arguments_are_refused(tiny):
    for rank in (0, 1):
        err = tiny["results"][rank, "tp8"]["error"]
        assert "tp group at (dp, pp) = (0, 0) spans processes [0, 1]" in err
        assert "Choose tp <= the number of devices per process (4)" in err
        assert tiny["results"][rank, "tp8"]["bytes_read"] == 0
        err = tiny["results"][rank, "disagree"]["error"]
        assert "disagree on the LLM arguments: tensor_parallel_size=4 on process 0 but 2 on process 1" in err


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")          # a zombie is not running
    except FileNotFoundError:
        return True


def test_killing_a_rank_mid_run_stops_the_job_naming_it(tiny):
    assert tiny["code"] == 3 and tiny["exit_s"] < 60, (tiny["code"], tiny["exit_s"])    # 3: a dead peer
    assert "rank 1 failed (killed by SIGKILL); stopped ranks [0]" in tiny["stderr"], tiny["stderr"][-2000:]
    assert all(_gone(pid) for pid in tiny["pids"].values())


def test_launcher_env_prefixes_and_failure(capfd):
    show = "import os; print(os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], os.environ['NPROC'])"
    assert launch([sys.executable, "-c", show], 3, 8) == 0
    out = capfd.readouterr().out
    assert sorted(line for line in out.splitlines()) == [f"[rank {r}] {r} 3 16" for r in range(3)]
    fail = "import os, sys, time; r = int(os.environ['JAX_PROCESS_ID']); time.sleep(30 * (r == 0)); sys.exit(5 * r)"
    t = time.monotonic()
    assert launch([sys.executable, "-c", fail], 2, grace_s=0.5) == 5
    assert time.monotonic() - t < 10                              # rank 0's sleep was cut short
    assert "launch: rank 1 failed (exit code 5); stopped ranks [0]" in capfd.readouterr().err
    assert launch([sys.executable, "-c", "import time; time.sleep(30)"], 2, timeout_s=1, grace_s=0.5) == 124
    assert "timed out after 1s with ranks [0, 1] still running" in capfd.readouterr().err


def _generate(*flags, env=ENV) -> subprocess.Popen:
    return start([sys.executable, GENERATE, "--simulate-devices", "4", "--max-tokens", "1", *flags], env=env)


def _finish(proc: subprocess.Popen, t: float) -> tuple[int, str, float]:
    _, err = proc.communicate(timeout=90)
    return proc.returncode, err, time.monotonic() - t


def test_wrong_coordinator_address_fails_fast_with_a_clear_error():
    address = f"127.0.0.1:{free_port()}"                         # nobody listens there
    t = time.monotonic()
    proc = _generate("--coordinator-address", address, "--num-processes", "2", "--process-id", "1",
                     env=dict(ENV, TP_JAX_INIT_TIMEOUT="5"))
    code, err, took = _finish(proc, t)
    assert code == 2 and took < 45, (code, took, err[-2000:])
    assert f"no coordinator answered at {address} within 5s" in err


def test_mismatched_process_counts_fail_fast_with_a_clear_error():
    """Rank 1 believes in 3 processes (JAX alone would not notice); and a job of 3 where 2 start."""
    t = time.monotonic()
    one, two = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    disagree = [_generate("--coordinator-address", one, "--num-processes", str(n), "--process-id", str(i))
                for i, n in enumerate((2, 3))]
    missing = [_generate("--coordinator-address", two, "--num-processes", "3", "--process-id", str(i),
                         env=dict(ENV, TP_JAX_INIT_TIMEOUT="5")) for i in range(2)]
    for proc in disagree:
        code, err, took = _finish(proc, t)
        assert code == 2 and took < 60, (code, took, err[-2000:])
        assert "disagree on the process count: num_processes=2 on process 0 but 3 on process 1" in err
    for proc in missing:
        code, err, took = _finish(proc, t)
        assert code == 3 and took < 60, (code, took, err[-2000:])
        assert "not every process connected. Check that --num-processes is the same on every host" in err


@pytest.mark.slow
def test_smollm2_dp2_tp4_on_two_processes_equals_one_process_bit_for_bit(smollm2_path):
    """The default model (its bf16 dots carry a float32 sum's last bit into the tokens): 2 processes x 4 devices,
    each a tp group, give the tokens and logprobs of 1 process x 8 devices, to the bit. XLA's own all-reduce sums in
    the order of its implementation (Gloo across processes, another in one): with it the logprobs differed by up to
    2e-2 here; the layers' "ordered" all-reduce adds in rank order on both."""
    from tp_jax.serving.llm import LLM
    from tp_jax.serving.sampling import SamplingParams
    prompts = ["Once upon a time", "The capital of France is"]
    flags = [a for p in prompts for a in ("--prompt", p)]
    proc = start(launch_cmd(GENERATE, "--tp", "4", "--dp", "2", *flags, "--max-tokens", "16", "--logprobs", "1",
                            "--json"))
    try:
        one = LLM(smollm2_path, tensor_parallel_size=4, data_parallel_size=2, progress=False)   # meanwhile
        outs = one.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    rows = [line for line in out.splitlines() if '{"index"' in line]
    assert len(rows) == 2 and {rank_of(r) for r in rows} == {0}                # only the driver prints
    for row, o in zip(sorted((json.loads(r.split("] ", 1)[1]) for r in rows), key=lambda r: r["index"]), outs):
        mine = o.outputs[0]
        assert row["token_ids"] == mine.token_ids and len(mine.token_ids) == 16
        expected = [{str(t): dataclasses.asdict(v) for t, v in d.items()} for d in mine.logprobs]
        assert row["logprobs"] == expected                      # Logprob fields: float32 logprobs, bit for bit


def test_resolve_takes_flags_then_env_then_cluster():
    from tp_jax.multihost.distributed import DistributedError, resolve
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert resolve(environ={}) is None and resolve(num_processes=1, environ={}) is None      # one process
    assert resolve(environ=env) == dict(coordinator_address="h:1", num_processes=2, process_id=1)
    assert resolve("a:2", 4, 3, environ=env) == dict(coordinator_address="a:2", num_processes=4, process_id=3)
    assert resolve(environ={"SLURM_STEP_NUM_TASKS": "2"}) == {}                         # JAX auto-detects
    with pytest.raises(DistributedError, match="missing: --coordinator-address / JAX_COORDINATOR_ADDRESS"):
        resolve(num_processes=2, process_id=0, environ={})
    with pytest.raises(DistributedError, match=r"process id 2 is not in \[0, 2\)"):
        resolve("a:1", 2, 2, environ={})
    with pytest.raises(DistributedError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        resolve(environ={"JAX_NUM_PROCESSES": "two"})


# --- two processes started by hand, without the launcher ---------------------------------------------------

@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, smollm2_path):
    """A tiny random Llama with SmolLM2's tokenizer: text in and out, quick to load."""
    return make_tokenized_checkpoint(str(tmp_path_factory.mktemp("by_hand")), smollm2_path)


class ByHand:
    """Two generate.py processes (dp=2 x tp=4, one replica each) joined on a loopback port."""

    def __init__(self, model: str, *flags: str):
        self.address = f"127.0.0.1:{free_port()}"
        env = dict(os.environ, TP_JAX_INIT_TIMEOUT="60")                   # the default heartbeat timeout (10 s)
        self.procs = [subprocess.Popen(
            [sys.executable, GENERATE, "--model", model, "--simulate-devices", "4", "--tp", "4", "--dp", "2",
             "--coordinator-address", self.address, "--num-processes", "2", "--process-id", str(i), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True) for i in range(2)]
        self.out, self.err = [[], []], [[], []]
        for i, p in enumerate(self.procs):
            for stream, sink in ((p.stdout, self.out[i]), (p.stderr, self.err[i])):
                threading.Thread(target=lambda st=stream, sk=sink: [sk.append(b) for b in iter(
                    lambda: os.read(st.fileno(), 65536), b"")], daemon=True).start()

    def text(self, sink: list) -> str:
        return b"".join(sink).decode(errors="replace")

    def wait_for_stdout(self, rank: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.out[rank]:
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs), \
                [self.text(e)[-2000:] for e in self.err]
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL every process group (each process and the child it supervises)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def strict_json(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def test_json_stdout_is_pure_json_in_a_two_process_run(tokenized):
    job = ByHand(tokenized, "--json", "--prompt", "Hello", "--prompt", "Bye now", "--max-tokens", "4")
    try:
        codes = [p.wait(timeout=300) for p in job.procs]
    finally:
        job.stop()
    time.sleep(0.2)                                                          # the readers' last chunks
    assert codes == [0, 0], [job.text(e)[-3000:] for e in job.err]
    rows = [strict_json(line) for line in job.text(job.out[0]).splitlines()]  # Gloo's lines are not here
    assert [(r["index"], r["prompt"], len(r["token_ids"])) for r in rows] == [(0, "Hello", 4), (1, "Bye now", 4)]
    assert job.text(job.out[1]) == ""                                        # only the driver prints


def _child(pid: int) -> int:
    """The supervised child of a generate.py process (tp_jax.multihost.supervisor forks it)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return int(f.read().split()[0])


@pytest.mark.parametrize("how,victim", [("SIGKILL", 1), ("SIGKILL", 0), ("SIGSTOP", 1)],
                         ids=["rank1_killed", "coordinator_killed", "rank1_frozen"])
def test_a_dead_peer_ends_the_survivor_within_30s_with_one_line_and_exit_3(tokenized, how, victim):
    job = ByHand(tokenized, "--stream", "--prompt", "Once upon a time", "--prompt", "Hello", "--max-tokens", "240",
                 "--ignore-eos", "--max-model-len", "256")
    try:
        job.wait_for_stdout(0, timeout=240)                                  # rank 0 is streaming tokens
        t = time.monotonic()
        if how == "SIGKILL":                                                 # the host dies: all its processes
            os.kill(job.procs[victim].pid, signal.SIGKILL)
        else:                                                                # alive but silent: no heartbeat
            os.kill(_child(job.procs[victim].pid), signal.SIGSTOP)
        survivor = job.procs[1 - victim]
        code = survivor.wait(timeout=90)
        took = time.monotonic() - t
    finally:
        job.stop()
    time.sleep(0.2)
    err = job.text(job.err[1 - victim])
    if victim == 0:
        line = (f"tp_jax: process 0 of 2 (the coordinator at {job.address}) died or cannot be reached; process 1 "
                f"stops too (exit 3)")
    else:
        line = "tp_jax: process 1 of 2 died or stopped responding (no heartbeat for 10 s); process 0 stops too (exit 3)"
    assert (code, err.splitlines()[-1]) == (3, line), err[-3000:]
    assert took < 30, took
    for noise in ("Traceback", "JaxRuntimeError", "Connection closed", "Check failure", "Terminating process",
                  "coordination_service"):                       # Gloo's error, JAX's C++ abort and its logs
        assert noise not in err, (noise, [x for x in err.splitlines() if "connected to" not in x])
    assert err.count("tp_jax:") == 1
