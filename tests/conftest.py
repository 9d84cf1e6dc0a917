"""Shared fixtures: a tiny random Llama checkpoint built in the test, and the embedded SmolLM2."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

# The files whose tests take longest (a CI run's --durations), run first: `make test` spreads files over
# two pytest-xdist workers (`--dist loadfile`: a file's tests stay on one worker and share its module
# fixtures), handing out files in collection order, so a long file collected last would run alone at the
# end while the other worker idles. Order only; a file missing here runs in its usual place.
LONGEST_FIRST = (
    "test_table1_quick.py",
    "test_sim_cli.py",
    "test_readme.py",
    "test_lifecycle.py",
    "test_online_orchestrator.py",
    "test_soak.py",
    "test_large_tensors.py",
    "test_demo.py",
    "test_replan_live.py",
    "test_runtime_exactness.py",
    "test_verification.py",
    "test_netem_swarm.py",
    "test_api_features.py",
    "test_online_policies.py",
    "test_prefix_live.py",
    "test_swarm.py",
    "test_direct_stream.py",
    "test_self_placement.py",
    "test_failover.py",
    "test_families_live.py",
    "test_prefix_dispatch_live.py",
    "test_cli_errors.py",
    "test_speculative_live.py",
    "test_lora_live.py",
    "test_stream_recovery.py",
    "test_relay.py",
    "test_overload.py",
)


# The files whose tests use `live_gateway`: they run one after the other (and on one xdist worker: see
# `pytest_xdist_make_scheduler`), so a run starts the gateway once and stops it when they are done.
LIVE_GATEWAY_FILES = ("test_api_gateway.py", "test_chat_page.py")
# the live gateway's stack of contexts (swarm, gateway), so that it can be stopped before the session ends
_LIVE_GATEWAY_STACK = pytest.StashKey[contextlib.ExitStack]()


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sorted() is stable: within a file, and among the files not listed, the collection order stays
    items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))
    users = {item.path.name for item in items if "live_gateway" in getattr(item, "fixturenames", ())}
    strays = sorted(users - set(LIVE_GATEWAY_FILES))
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add {strays} to LIVE_GATEWAY_FILES (they use live_gateway)")
    # the live gateway's files together, where the first of them stands
    shared = [item for item in items if item.path.name in LIVE_GATEWAY_FILES]
    if shared:
        first = items.index(shared[0])
        rest = [item for item in items if item.path.name not in LIVE_GATEWAY_FILES]
        items[:] = rest[:first] + shared + rest[first:]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it, never called
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (make test) with the files of LIVE_GATEWAY_FILES as one work unit: one worker runs
    them in turn, so the suite starts the shared gateway once, not once per worker that gets one of them."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler
    # xdist sorts the files by how many tests they hold, most first, unless told not to: that ran the
    # long live files of LONGEST_FIRST (a few tests each) last, one worker busy alone for 20 min at the end
    config.option.loadscopereorder = False
    from xdist.scheduler import LoadFileScheduling

    class SharedGatewayScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "live_gateway" if path.rsplit("/", 1)[-1] in LIVE_GATEWAY_FILES else path

    return SharedGatewayScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    """A randomly initialised 6-block Llama (GQA 4/2 heads) saved as a safetensors checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted into the cache on first use."""
    from petals_chain.models.checkpoint import resolve_model_path

    return resolve_model_path("smollm2-135m", show_progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_chat_path(tmp_path_factory, smollm2_path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template: cheap servers and chats that
    run the CLI as users run it (`generate`, `chat`, the demo need a tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_family_path(tmp_path_factory):
    """`tiny_family_path(variant)`: a tiny random checkpoint of that family variant
    (tests/family_checkpoints.py), built once per test session."""
    from tests.family_checkpoints import save_tiny

    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = save_tiny(variant, tmp_path_factory.mktemp(f"tiny-{variant}"))
        return built[variant]

    return get


@pytest.fixture(scope="session")
def live_gateway(request, smollm2_path):
    """One live swarm of the embedded SmolLM2 (two servers, blocks [0, 15) and [15, 30), prefix caches on,
    info logs: the servers' "session ... opened" lines carry the gateway's request ids) and `petals-chain
    api` over it (one API key, 4 sessions at once): a `LiveGateway`. Shared by the files of
    LIVE_GATEWAY_FILES, so a run starts it once: the first time a test asks for it; it stops after the
    last test of those files (see `pytest_runtest_teardown`). Its users leave no session running and
    read the gateway's counters as differences."""
    from petals_chain.swarm.local import LocalSwarm
    from tests.swarm_helpers import LIVE_GATEWAY_KEY, running_gateway

    with contextlib.ExitStack() as stack:
        request.config.stash[_LIVE_GATEWAY_STACK] = stack
        server_args = ["--num-threads", "1", "--log-level", "info"]
        swarm = stack.enter_context(LocalSwarm("smollm2-135m", [(0, 15), (15, 30)], server_args=server_args))
        yield stack.enter_context(running_gateway(swarm, key=LIVE_GATEWAY_KEY, max_concurrent=4))


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the test's narrower fixtures
def pytest_runtest_teardown(item, nextitem):
    """Stops the live gateway and its swarm after the last test of LIVE_GATEWAY_FILES (they run together),
    not at the end of the run: idle servers would hold memory and CPU through every later file."""
    last = nextitem is None or nextitem.path.name not in LIVE_GATEWAY_FILES
    if item.path.name in LIVE_GATEWAY_FILES and last:
        stack = item.config.stash.get(_LIVE_GATEWAY_STACK, None)
        if stack is not None:
            stack.close()  # the fixture's own exit at the end of the session then finds nothing left to stop
