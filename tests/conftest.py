"""Shared fixtures; with DPKIT_REQUIRE_MULTIPROCESS=1 (CI) a skipped multi-process test fails."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
# A recipe run writes up to ~0.6 GB (fp32 model 91 MB, a checkpoint 273 MB); the heaviest
# module holds about 3 GB at once. Below this the session would fail half-way, in runs
# that die on ENOSPC with errors about everything but the disk.
MIN_FREE_DISK_GIB = 6


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of one rank in this process, gone after the test."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}"
    )
    yield
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.cdb is not None and ds_comm.cdb.is_initialized():
        # Through DeepSpeed when it used the group: it also drops the groups it cached
        # (deepspeed.utils.groups), which a later test's DeepSpeed would otherwise reuse
        # after this group is gone ("Group ... is not registered").
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


def hides_gpus(markexpr: str) -> bool:
    """Whether a pytest run with ``-m markexpr`` runs without GPUs: all but ``-m gpu``."""
    return markexpr.strip() != "gpu"


def pytest_configure(config: pytest.Config) -> None:
    """Keep a mutant in this process; hide the GPUs from the CPU suite; DeepSpeed's ops
    built per venv (below)."""
    if "mutmut" in sys.modules:
        # Under ``make mutate`` each mutant's tests are a pytest session forked from one
        # that has imported torch, transformers and every test module. pytest ends each
        # session with several full garbage collections, which walk that whole heap:
        # 1.3 s of every mutant's 1.4 s when its tests are fast. Frozen objects are not
        # walked; nothing the tests allocate is frozen.
        gc.freeze()
    keep_mutant_in_process()
    hide_gpus(config)
    extensions_per_venv()


def extensions_per_venv() -> None:
    """DeepSpeed's JIT-built ops (``cpu_adam``, ``deepspeed_shm_comm``) in a folder of this
    venv's own, unless ``TORCH_EXTENSIONS_DIR`` is set (``make`` sets the same one).

    torch keeps every build in ``~/.cache/torch_extensions/py311_cpu`` whatever the venv,
    and a build made against another venv's torch headers (the include paths differ) is
    rebuilt: where two venvs take turns, each launch that loads an op rebuilds it, 75 to
    570 s for ``cpu_adam`` and 33 to 290 s for ``deepspeed_shm_comm`` on the 2-core CI box
    (their .ninja_log: 8 and 14 builds in 15.5 hours, 1,609 s and 912 s). Keyed by the
    venv's path, a folder is built once and stays valid for that venv; the launches'
    workers inherit the variable.
    """
    import hashlib

    venv = str(Path(sys.prefix).resolve())
    key = hashlib.sha256(venv.encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "torch_extensions" / f"venv-{key}"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default))
    # The same ninja here as in the launches (tests.harness puts the venv's bin first on
    # their PATH): DeepSpeed depends on pip's ninja (1.13 here), the system may have another
    # (1.11), and the two hash a build's commands differently, so each rebuilds what the
    # other built: cpu_adam 41 to 128 s a time, three times in one launch suite (measured
    # here from the folder's .ninja_log).
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def keep_mutant_in_process() -> None:
    """Under ``make mutate``: the mutant under test stays in this process.

    mutmut names the active mutant in ``MUTANT_UNDER_TEST`` and also keeps it in its own
    process-local state, which its trampolines read when the variable is absent. A test
    that starts a process (a CLI in another folder, a launch) would hand the variable on,
    and the child, outside mutmut's folder, fails to find its configuration. Dropped
    here, the child runs the code unmutated: only in-process tests judge a mutant.
    """
    os.environ.pop("MUTANT_UNDER_TEST", None)


# mutmut's record, in its folder (the tests' working directory under ``make mutate``), of
# how long each test took when it ran the unmutated code.
MUTMUT_STATS = Path("mutmut-stats.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``make mutate``: run a mutant's tests fastest first.

    mutmut runs the tests that reach the mutated function with ``-x``, in no particular
    order, so a mutant that a 0.01 s test kills can wait behind a 15 s one. Most mutants
    are killed; ordering by the unmutated run's times makes each of those cost about its
    fastest killing test. A survivor still runs them all. Outside mutmut the order is
    left alone.
    """
    if "mutmut" not in sys.modules or not MUTMUT_STATS.is_file():
        return
    seconds = json.loads(MUTMUT_STATS.read_text()).get("duration_by_test", {})
    items.sort(key=lambda item: seconds.get(item.nodeid, float("inf")))


@pytest.fixture(autouse=True)
def traces_timed_from_cold_under_mutmut() -> None:
    """Under ``make mutate``, while mutmut times the unmutated tests: no activation trace
    carried over from an earlier test.

    A process caches its traces (``dpkit.plan.activations._traced``), so in one session
    only the first test to plan a model pays for its trace (seconds) and the others
    read 0.06 s. Each mutant's tests start with an empty cache: timed from cold, the
    order above puts first the tests that are fast there too (a hand-sized model traced
    directly), not whichever one happened to follow the trace.
    """
    if "mutmut" not in sys.modules:
        return
    from mutmut.mutation.trampoline import get_mutant_under_test

    if get_mutant_under_test() == "stats":
        from dpkit.plan.activations import _traced

        _traced.cache_clear()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``make mutate``: warm the libraries up in the session every mutant forks from.

    mutmut's fork server collects the tests once (``--collect-only``) and forks a process
    per mutant from there. What the tests then import or build for the first time, each
    mutant's process does again: building and running the first transformers model on
    the meta device takes 1.6 s (torch's meta kernels and dynamo's wrappers load on first
    use), peft 1.6 s more. Done here once, every fork inherits it. Only torch,
    transformers and their kin run here, never dpkit: a result dpkit caches (an
    activation trace) must come from the mutant under test.
    """
    if "mutmut" in sys.modules and session.config.option.collectonly:
        warm_up_libraries()


def warm_up_libraries() -> None:
    """Import what the fast tests import lazily, and run one forward with a loss of each
    model family they build (GPT-2, Llama, a BERT classifier), all on the meta device:
    a CPU kernel here would start the OpenMP threads, which a forked process inherits
    dead (its first parallel CPU op hangs)."""
    import matplotlib.pyplot  # noqa: F401  (the memory timeline)
    import peft  # noqa: F401
    import sklearn.metrics  # noqa: F401
    import torch
    import transformers.trainer  # noqa: F401
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tiny = {"vocab_size": 16, "bos_token_id": 0, "eos_token_id": 0}
    configs = [
        (GPT2LMHeadModel, GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=8, **tiny)),
        (LlamaForCausalLM, LlamaConfig(
            hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            **tiny,
        )),
        (BertForSequenceClassification, BertConfig(
            hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            vocab_size=16,
        )),
    ]  # fmt: skip
    with torch.device("meta"):
        ids = torch.zeros((1, 4), dtype=torch.long)
        for model_class, config in configs:
            model = model_class(config)
            labels = ids[:, 0] if model_class is BertForSequenceClassification else ids
            model(input_ids=ids, labels=labels)


def hide_gpus(config: pytest.Config) -> None:
    """Hide the GPUs from the CPU suite, unless the run selects only ``gpu`` tests.

    The suite asserts CPU outcomes (gloo, MULTI_CPU, ZeRO's CPU buckets); on a CUDA box
    torch, accelerate and DeepSpeed would pick the GPUs and NCCL instead, and several
    ranks on one GPU fail. ``CUDA_VISIBLE_DEVICES=""`` set here, before any test module
    imports torch, reaches this process and every launch the tests start (they copy
    ``os.environ``). ``pytest -m gpu`` keeps the GPUs; a run that mixes GPU and CPU
    tests (no ``-m`` at all, ``-m "not multiprocess"``) hides them, and its ``gpu``
    tests skip as they do without a GPU. ``deepspeed --num_gpus N`` gives its workers
    ``CUDA_VISIBLE_DEVICES=0..N-1`` whichever accelerator it picks
    (``deepspeed/launcher/launch.py``): ``tests.harness.deepspeed_cmd`` hides them again
    in the worker command on a machine with GPUs.
    """
    if not hides_gpus(config.getoption("markexpr")):
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises.
        pytest.exit("CUDA was initialised before tests/conftest.py could hide the GPUs", 2)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_sessionstart(session: pytest.Session) -> None:
    root = Path(session.config.option.basetemp or tempfile.gettempdir()).absolute()
    while not root.exists():
        root = root.parent
    free_gib = shutil.disk_usage(root).free / 2**30
    if free_gib < MIN_FREE_DISK_GIB:
        pytest.exit(
            f"only {free_gib:.1f} GiB free under {root}; the tests need {MIN_FREE_DISK_GIB} GiB",
            returncode=2,
        )


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request) -> Iterator[Path]:
    """A folder for the launches a module shares between its tests; removed after the
    module unless one of its tests failed (then it is kept for inspection), or unless
    ``-o tmp_path_retention_policy=all`` asks to keep everything."""
    failed_before = request.session.testsfailed
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    keep_all = request.config.getini("tmp_path_retention_policy") == "all"
    if not keep_all and request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def warm_recipe(tmp_path_factory):
    """The recipe for runs that stop before training, forked from one warm process."""
    from tests.harness import WarmRecipe

    warm = WarmRecipe(tmp_path_factory.mktemp("warm-recipe"))
    yield warm
    warm.close()


@pytest.fixture(scope="session")
def recipe_runs(tmp_path_factory):
    """The recipe's short runs under each launch form (tests/recipe_runs.py), each launched
    once per session and shared by the modules that check them."""
    from tests.recipe_runs import RecipeRuns

    return RecipeRuns(tmp_path_factory.mktemp("recipe-runs"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The checkpointed reference runs (tests/checkpoint_runs.py), each launched once per
    session and shared by the modules that resume from or compare with them."""
    from tests.checkpoint_runs import ReferenceRuns

    return ReferenceRuns(tmp_path_factory.mktemp("reference-runs"))


@pytest.fixture(scope="session")
def wheel_env(tmp_path_factory):
    """dpkit built as a wheel and installed into a fresh venv outside the checkout
    (tests/wheel_env.py); built once per session."""
    from tests import wheel_env as wheel

    return wheel.build(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leaks():
    """Fail the session if any run left DeepSpeed's /dev/shm segments behind (66 MB each)."""
    before = set(SHM.glob("deepspeed_*")) if SHM.is_dir() else set()
    yield
    after = set(SHM.glob("deepspeed_*")) if SHM.is_dir() else set()
    leaked = sorted(p.name for p in after - before)
    assert not leaked, f"runs left {len(leaked)} DeepSpeed /dev/shm segments: {leaked[:4]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    required = os.environ.get("DPKIT_REQUIRE_MULTIPROCESS") == "1"
    if required and report.skipped and item.get_closest_marker("multiprocess"):
        report.outcome = "failed"
        report.longrepr = (
            f"multi-process test skipped under DPKIT_REQUIRE_MULTIPROCESS=1: {report.longrepr}"
        )
