"""8 simulated CPU devices for every test, set before jax starts (see docs/running.md).

NPROC >= 2 x devices avoids the XLA:CPU collective deadlock on 2-core machines; the
collective timeout turns any remaining hang into a fast failure; LLVM compiles at -O0 (below).
"""

import os

os.environ["NPROC"] = str(max(int(os.environ.get("NPROC", "0") or 0), 16))
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "collective_call_terminate_timeout" not in _flags:
    _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=60"
# The flags a user's run has (XLA's default LLVM level, -O3): what `default_compile` tests run under, below.
USER_XLA_FLAGS = os.environ.setdefault("TP_JAX_USER_XLA_FLAGS", _flags.strip())    # xdist workers: as set here
# Everything else with LLVM at -O0: compiling was 71% of the suite's time and -O0 cuts XLA:CPU's backend compile
# ~3x (the optimized HLO, its fusions and library dots are the same; the loops run slower, so the files that
# mostly run the real model are marked `llvm_level(1)`). Not the numbers bit for bit: below -O3 a float32
# tp = 2 logprob moved by 1 ulp with the rows beside it (the cause, likely where LLVM fuses a multiply and an
# add, is not confirmed), so the batch-invariance tests are `default_compile`, at -O3 (docs/running.md)
IN_CHILD = "TP_JAX_TEST_CHILD"
if "xla_backend_optimization_level" not in _flags and not os.environ.get(IN_CHILD):
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the KV pools of the many models a session loads: at most 512 MiB each by default (see kv_pool.py)
os.environ.setdefault("TP_JAX_CPU_KV_CACHE_BYTES", str(512 * 2**20))
os.environ.setdefault("TP_JAX_TOKENIZER_CACHE", __import__("tempfile").mkdtemp(prefix="tp_jax_tok_"))
# JAX's persistent compilation cache (on by default in LLM) in a directory of this session, never ~/.cache
os.environ.setdefault("TP_JAX_COMPILE_CACHE", __import__("tempfile").mkdtemp(prefix="tp_jax_xla_"))
# every program, however fast it compiled (at -O0 most compile in under LLM's 0.5 s threshold): the suite builds
# the same model at the same mesh many times over, and an identical program is then read, not compiled again
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from tp_jax.parallel.mesh import make_mesh  # noqa: E402

# --- files compiled otherwise: all of a file's tests in one child pytest under other XLA flags ----------------


def pytest_configure(config):
    config.addinivalue_line("markers", "default_compile: runs in a child process at XLA's default LLVM level, "
                                       "not the suite's -O0 (numbers that must hold bit for bit as users compile)")
    config.addinivalue_line("markers", "llvm_level(n): runs in a child process at LLVM -On (a file whose time is "
                                       "running its programs more than compiling them)")


_CHILD_RESULTS = "TP_JAX_CHILD_RESULTS"        # in a child: the file its tests' outcomes are written to


def child_flags(item) -> str | None:
    """The XLA_FLAGS `item` runs under when they are not this process's (None: it runs here)."""
    if os.environ.get(IN_CHILD) or "xla_backend_optimization_level" in USER_XLA_FLAGS:     # the user's level rules
        return None
    if item.get_closest_marker("default_compile"):
        return USER_XLA_FLAGS
    level = item.get_closest_marker("llvm_level")
    return f"{USER_XLA_FLAGS} --xla_backend_optimization_level={level.args[0]}" if level else None


class ChildRun:
    """One child pytest for a file's tests under other flags (its fixtures, models and compiled programs shared
    as in one process), started by the first of them to run: each test's (outcome, failure or skip text),
    compile seconds, peak memory and seconds freeing memory."""

    def __init__(self, nodeids: list[str], flags: str, rootpath):
        self.nodeids, self.flags, self.rootpath, self.outcomes, self.compile_s = nodeids, flags, rootpath, None, {}
        self.peak_rss: dict[str, int] = {}      # nodeid -> the child's peak resident bytes while it ran
        self.freeing_s: dict[str, float] = {}   # nodeid -> the child's seconds freeing memory after it

    def outcome(self, nodeid: str) -> tuple[str, str]:
        if self.outcomes is None:
            self.outcomes = self._run()
        return self.outcomes[nodeid]

    def _run(self) -> dict[str, tuple[str, str]]:
        import json
        import tempfile
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as results:
            env = {**os.environ, IN_CHILD: "1", "XLA_FLAGS": self.flags, _CHILD_RESULTS: results.name}
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:xdist", *self.nodeids],
                                 env=env, cwd=str(self.rootpath), capture_output=True, text=True)
            print(run.stdout[-4000:])
            found: dict[str, tuple[str, str]] = {}
            for line in results:                   # a test's phases in order: a failed teardown after a pass fails
                nodeid, outcome, text, compiled, peak, freeing = json.loads(line)
                self.compile_s[nodeid] = self.compile_s.get(nodeid, 0.0) + compiled
                self.freeing_s[nodeid] = self.freeing_s.get(nodeid, 0.0) + freeing
                self.peak_rss[nodeid] = max(self.peak_rss.get(nodeid, 0), peak)
                if found.get(nodeid, ("passed",))[0] == "passed":
                    found[nodeid] = (outcome, text)
        missing = ("failed", f"did not run in its child process (exit {run.returncode}):\n{run.stdout[-6000:]}"
                             f"{run.stderr[-2000:]}")
        return {i: found.get(i, missing) for i in self.nodeids}


class ChildItem(pytest.Item):
    """Stands in here for a test that runs in a child: no fixtures set up in this process, the child's outcome."""

    def __init__(self, *, child: ChildRun, **kw):
        super().__init__(**kw)
        self.child = child

    def runtest(self):
        outcome, text = self.child.outcome(self.nodeid)
        _COMPILING[0] += self.child.compile_s.get(self.nodeid, 0.0)
        _CHILD_PEAK[0] = self.child.peak_rss.get(self.nodeid, 0)
        _FREEING[0] += self.child.freeing_s.get(self.nodeid, 0.0)
        if outcome == "skipped":
            pytest.skip(text)
        if outcome != "passed":
            pytest.fail(f"{self.nodeid} failed in its child process (XLA_FLAGS={self.child.flags!r}):\n{text}",
                        pytrace=False)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(trylast=True)                 # after -m / -k deselected
def pytest_collection_modifyitems(session, config, items):
    runs: dict = {}
    for k, item in enumerate(items):
        flags = child_flags(item)
        if flags is None:
            continue
        if (item.path, flags) not in runs:
            ids = [i.nodeid for i in items if i.path == item.path and child_flags(i) == flags]
            runs[item.path, flags] = ChildRun(ids, flags, config.rootpath)
        items[k] = ChildItem.from_parent(item.parent, name=item.name, child=runs[item.path, flags])
        items[k].own_markers = list(item.iter_markers())
        items[k].keywords.update(item.keywords)


def pytest_runtest_logreport(report):
    """Each report's seconds for the per-file table; in a child also its outcome, for its `ChildItem` in the
    parent."""
    _count_file_seconds(report)
    if os.environ.get(_CHILD_RESULTS):
        import json
        text = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else str(report.longrepr)
        compiled = sum(v for k, v in report.user_properties if k == "compile_s")
        peak = max([v for k, v in report.user_properties if k == "peak_rss"] or [0])
        freeing = sum(v for k, v in report.user_properties if k == "freeing_s")
        with open(os.environ[_CHILD_RESULTS], "a") as f:
            f.write(json.dumps([report.nodeid, report.outcome, "" if report.passed else text, compiled, peak,
                                freeing]) + "\n")


# (dp, pp, tp) shapes for layer tests: tp in {1, 2, 4, 8}, and tp = 3 on 6 devices (dp = 2).
TP_MESHES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 1, 3)]


def mesh_for(dp: int, pp: int, tp: int):
    n = dp * pp * tp
    return make_mesh(dp, pp, tp, devices=jax.devices()[:n])


@pytest.fixture(params=TP_MESHES, ids=lambda s: "dp{}pp{}tp{}".format(*s))
def mesh(request):
    return mesh_for(*request.param)


def machine() -> str:
    from tp_jax.parallel.layers.quantization import cpu_flags
    simd = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    return f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform}; cpu: {os.cpu_count()} " \
           f"cores, {simd or 'no AVX'}"


def pytest_report_header(config):
    return machine()


# --- the real SmolLM2-135M-Instruct, shared by the tests that need it ------------------------

@pytest.fixture(scope="session")
def smollm2_path():
    from tp_jax.loaders.default import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own GGUF load of SmolLM2 (its dequantizer and un-permutation), float32."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                 gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_path, tmp_path_factory):
    """SmolLM2 converted to an HF directory (float32 safetensors + tokenizer) by our converter."""
    from tp_jax.loaders.convert import convert_gguf
    out = str(tmp_path_factory.mktemp("smollm2_hf"))
    convert_gguf(smollm2_path, out, "float32")
    return out


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2_path, tmp_path_factory):
    """SmolLM2 as bf16 safetensors (the GGUF's weights rounded to bf16; HF's own SmolLM2 is stored in bf16)."""
    from tp_jax.loaders.convert import convert_gguf
    out = str(tmp_path_factory.mktemp("smollm2_bf16"))
    convert_gguf(smollm2_path, out, "bfloat16")
    return out


# --- the OpenAI-compatible server as a subprocess (tests/server_process.py), shared by the server tests ----
from tests.server_process import client, ref, tiny_path, tiny_server  # noqa: E402,F401


# --- each test file's time and memory, reported at the end of every run (CI's log) against their budgets ----
FILE_BUDGET_S = 240            # a file over this is listed as over budget: split it or share its fixtures
# the peak resident memory of the process running a file (an xdist worker with what its earlier files keep in
# session fixtures, or a file's child pytest): two workers, each with a child, share the CI machine's 24 GiB,
# with no swap; past it every process thrashes (a CI run once took 13 min over a 2-min file). A file over this
# keeps too many models alive: free them as its tests finish with them.
FILE_MEMORY_BUDGET = 6 * 2**30
_FILE_PEAK: dict[str, int] = {}
_FREEING_SECONDS = [0.0]                     # all test processes' seconds in _give_back_memory
_CHILD_PEAK = [0]                            # the child's peak for the test a ChildItem stands for
_LAST_FILE = [None]


def _resident(key: str = "VmRSS") -> int:
    """This process's resident bytes now ("VmRSS") or at their peak since the last `_reset_peak` ("VmHWM"), 0
    where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":")), 0)
    except OSError:
        return 0


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:     # "5": reset the peak resident set size to the current
            f.write("5")
    except OSError:
        pass


def _give_back_memory():
    """Free what the tests left: the models in reference cycles (LLM objects), then the heap pages glibc keeps
    for reuse (the XLA buffers of the freed models, spread over its arenas). Without it a worker grew to 8 GiB
    after SmolLM2's files, the models long gone."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):           # not glibc
        pass


# ... and after a test that left its process this much above where the last freeing left it (a file of many
# models). Not after every test: a full collection costs up to a second in a worker holding torch, transformers
# and JAX, and at 3 GiB as the trigger the suite ran 35% longer
RSS_GROWTH_TRIM = 2**30
_RSS_AFTER_TRIM = [0]
_FREEING = [0.0]                    # this process's seconds spent freeing, not yet attached to a report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield                                       # the test's fixtures (a module's, at its last test) are gone
    if nextitem is None or nextitem.path != item.path or _resident() > _RSS_AFTER_TRIM[0] + RSS_GROWTH_TRIM:
        import time
        start = time.perf_counter()
        _give_back_memory()
        _RSS_AFTER_TRIM[0] = _resident()
        _FREEING[0] += time.perf_counter() - start


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.path != _LAST_FILE[0]:               # a new file: its peak counts from here
        _LAST_FILE[0] = item.path
        _reset_peak()


_FILE_SECONDS: dict[str, float] = {}
_COMPILE_SECONDS: dict[str, float] = {}      # of which: JAX tracing, lowering and XLA compiling (jax.monitoring)
_COMPILING = [0.0]                           # this process's compile seconds not yet attached to a report


def _count_compile(event: str, duration: float, **_):
    if event.startswith("/jax/core/compile/"):
        _COMPILING[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Runs where the test runs (an xdist worker): the compile seconds travel in the report to the controller."""
    outcome = yield
    outcome.get_result().user_properties.append(("compile_s", _COMPILING[0]))
    outcome.get_result().user_properties.append(("peak_rss", max(_resident("VmHWM"), _CHILD_PEAK[0])))
    outcome.get_result().user_properties.append(("freeing_s", _FREEING[0]))
    _COMPILING[0], _CHILD_PEAK[0], _FREEING[0] = 0.0, 0, 0.0


def _count_file_seconds(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    compiled = sum(v for k, v in report.user_properties if k == "compile_s")
    _COMPILE_SECONDS[path] = _COMPILE_SECONDS.get(path, 0.0) + compiled
    _FREEING_SECONDS[0] += sum(v for k, v in report.user_properties if k == "freeing_s")
    _FILE_PEAK[path] = max([_FILE_PEAK.get(path, 0)] + [v for k, v in report.user_properties if k == "peak_rss"])


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    terminalreporter.write_sep("=", f"seconds per test file (budget {FILE_BUDGET_S} s each), and the peak memory "
                                    f"of the process running it (budget {gib(FILE_MEMORY_BUDGET)})")
    heavy = [kv for kv in sorted(_FILE_PEAK.items(), key=lambda kv: -kv[1]) if kv[1] > FILE_MEMORY_BUDGET]
    for path, secs in rows[:15] + [(p, _FILE_SECONDS[p]) for p, _ in heavy if p not in dict(rows[:15])]:
        flag = "  OVER BUDGET" if secs > FILE_BUDGET_S else ""
        flag += "  OVER MEMORY BUDGET" if _FILE_PEAK.get(path, 0) > FILE_MEMORY_BUDGET else ""
        terminalreporter.write_line(f"{secs:8.1f} s  {path}  ({_COMPILE_SECONDS.get(path, 0.0):.0f} s compiling; "
                                    f"peak {gib(_FILE_PEAK.get(path, 0))}){flag}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f} s  in all ({len(rows)} files; "
                                f"{sum(_COMPILE_SECONDS.values()):.0f} s compiling, {_FREEING_SECONDS[0]:.0f} s "
                                f"freeing memory; the highest peak {gib(max(_FILE_PEAK.values(), default=0))}); "
                                f"{machine()}")
