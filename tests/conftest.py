"""Shared test set-up: `gpu` tests run only where torch sees a CUDA device (the H200 round);
`nginx_server`, a real HTTP cache (nginx with WebDAV PUT on 127.0.0.1) for the remote-cache tests;
`world_dir`, a temp dir other users can reach (tests that drop to `nobody` to meet an unreadable file)."""
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def _have_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAVE_GPU = _have_gpu()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_cache_dir():
    """The prepared cache the GPU tests load from (carried to the GPU machine)."""
    d = os.environ.get("MUSEKERN_CACHE_DIR")
    if not d or not os.path.isdir(d):
        pytest.skip("MUSEKERN_CACHE_DIR must point at a prepared cache (see bench/gpu_round.sh)")
    return d


HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


@pytest.fixture
def no_proxy(monkeypatch):
    """CI may set http_proxy; the test server is local."""
    for v in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture
def nginx_server(tmp_path, no_proxy):
    """(base URL, document root Path) of a fresh nginx serving GET/HEAD/PUT."""
    exe = _nginx_binary()
    if exe is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx) - remote cache tests need a real HTTP server")
    run, root = tmp_path / "nginx-run", tmp_path / "nginx-root"
    run.mkdir()
    root.mkdir()
    template = (HERE / "nginx" / "nginx.conf.in").read_text()
    # As root nginx would drop its workers to `nobody`, which cannot write our 0700 temp dirs.
    user_line = "user root;" if os.geteuid() == 0 else ""
    last_err = ""
    for _attempt in range(3):  # the free port may be taken between probe and bind: retry
        port = free_port()
        conf = run / "nginx.conf"
        conf.write_text(template.replace("@USER_LINE@", user_line).replace("@RUN@", str(run))
                        .replace("@ROOT@", str(root)).replace("@PORT@", str(port)))
        proc = subprocess.Popen([exe, "-p", str(run), "-e", str(run / "error.log"), "-c", str(conf),
                                 "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        up = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                up = True
                break
            except OSError:
                time.sleep(0.05)
        if up:
            break
        proc.kill()
        last_err = proc.communicate()[1].decode(errors="replace")
    else:
        pytest.skip(f"nginx did not start: {last_err.strip()[-500:]}")
    try:
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def world_dir():
    """A temp dir every user can traverse (pytest's tmp_path is 0700: `nobody` could not reach it)."""
    d = tempfile.mkdtemp(prefix="musekern-fs-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def as_if_cuda(monkeypatch):
    """CPU tensors that claim to live on CUDA device 0: the ops' fast paths (device checks included) run here."""
    import torch

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0)


class _Recorder:
    """A stand-in launcher (LoadedKernel.launcher's signature) that keeps the values of each launch: `calls`."""

    def __init__(self):
        self.calls = []

    def __call__(self, values, stream=None):
        self.calls.append(list(values))


@pytest.fixture
def recorder():
    return _Recorder()
