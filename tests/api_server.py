"""Start and stop vLLM's OpenAI server, read /metrics, measure RSS.

Used by the serving tests and by the online benchmark.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm`` console
script does not work, see README), started in its own session so that the whole process tree
(API server, engine core, workers) is stopped with one signal to the process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SERVED_MODEL_NAME = "tiny"
START_TIMEOUT_S = float(os.environ.get("SELFSPEC_SERVER_START_TIMEOUT", "300"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    model_dir: os.PathLike | str,
    port: int,
    speculative_config: dict | None = None,
    max_model_len: int = 192,
    kv_cache_memory_bytes: int = 1 << 27,
    extra_args: Sequence[str] = (),
) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_cache_memory_bytes),
        "--seed", "0",
    ]  # fmt: skip
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd + list(extra_args)


class ApiServer:
    """A running OpenAI-compatible vLLM server (see :func:`api_server`)."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=5)[0] == 200
        except (OSError, urllib.error.URLError):
            return False

    def metrics_text(self, timeout: float = 10.0) -> str:
        status, text = self.get("/metrics", timeout=timeout)
        assert status == 200, text[:500]
        return text

    def metrics(self, timeout: float = 10.0) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse_metrics(self.metrics_text(timeout))

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def rss_bytes(self) -> int:
        return process_tree_rss(self.proc.pid)

    def rss_by_process(self) -> dict[str, int]:
        """{"pid:name": RSS in MiB} for the server's process tree."""
        import psutil

        out = {}
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    out[f"{p.pid}:{p.name()}"] = p.memory_info().rss >> 20
        except psutil.NoSuchProcess:
            pass
        return out


@contextlib.contextmanager
def api_server(
    cmd: list[str], port: int, env: dict[str, str] | None = None, name: str = "server"
) -> Iterator[ApiServer]:
    """Start ``cmd`` in a new session, wait for /health, and stop the whole group on exit."""
    _exit_on_sigterm()
    log_dir = Path(tempfile.mkdtemp(prefix=f"selfspec-{name}-"))
    log_path = log_dir / "server.log"
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    server = ApiServer(proc, port, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.healthy():
            if not server.alive():
                raise RuntimeError(
                    f"{name} exited with {proc.returncode} during start:\n{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy after {START_TIMEOUT_S}s:\n"
                                   f"{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        stop_process_group(proc)


def _exit_on_sigterm() -> None:
    """Turn SIGTERM (a CI timeout, ``kill``) into SystemExit so that ``finally`` blocks stop the
    servers; by default SIGTERM ends Python without running them and leaves the servers behind."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

        def _raise(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _raise)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group (clean shutdown, ~3 s), SIGKILL it if it lingers."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if pgid is not None:
        # children (engine core, workers) may outlive the API server by a moment
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def process_tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants, in bytes."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_info().rss
    return total


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def metric_value(metrics: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (KeyError if absent)."""
    samples = metrics[name]
    return sum(v for lab, v in samples if all(lab.get(k) == x for k, x in labels.items()))


SHM_DIR = Path("/dev/shm")
# vLLM's CPU TP communicator ("<port>-tp:0-[0-1]-cpushm_<rank>") and its shared-memory message
# queues ("psm_<hex>", Python's multiprocessing.shared_memory): a process killed before it shuts
# down leaves them behind, tmpfs pages held in RAM. A later engine whose distributed port happens
# to match a stale communicator name fails at start ("create shm in SHMManager failed. errno: 17").
_VLLM_SHM_MARKERS = ("cpushm", "psm_")


@contextlib.contextmanager
def removing_leaked_shm() -> Iterator[None]:
    """Remove the vLLM shared-memory files that appear while the block runs and outlive it.

    For blocks that run an engine in a process group they kill (Ray's actors are killed, not shut
    down, when their driver exits). Only files created during the block and neither open nor
    mapped by a live process are removed (other engines on the machine keep theirs).
    """
    before = set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()
    try:
        yield
    finally:
        if SHM_DIR.is_dir():
            new = {
                name
                for name in set(os.listdir(SHM_DIR)) - before
                if any(marker in name for marker in _VLLM_SHM_MARKERS)
            }
            for name in new - _shm_in_use() if new else ():
                with contextlib.suppress(FileNotFoundError):
                    (SHM_DIR / name).unlink()


def _shm_in_use() -> set[str]:
    """Names of the files under /dev/shm that a live process has open or mapped."""
    used: set[str] = set()
    prefix = f"{SHM_DIR}/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(prefix):].split()[0])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        used.add(target[len(prefix):].split()[0])
    return used
