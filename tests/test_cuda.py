"""The GPU path, run wherever CUDA is present (skipped with the reason otherwise; the CPU suite checks
device placement in tests/test_device_placement.py).

Exactness against transformers on the same device: float32 greedy tokens identical (in-process and
through real servers, with CUDA graphs replaying the decode steps); bfloat16 logits within a
tolerance; nf4 and int8 equal to transformers loaded with the same bitsandbytes config; multi-turn
sessions and prefix-cache hits through a CUDA server.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")

PROMPT = [5, 17, 42, 99, 7, 300, 12, 8, 77, 150, 3, 64]


def make_gpu_llama(path, dtype=torch.float32):
    """A random Llama a little wider than the CPU suite's (bitsandbytes blocks, SDPA kernels)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).to(dtype).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpu_llama_path(tmp_path_factory):
    return make_gpu_llama(tmp_path_factory.mktemp("gpu-llama"))


@pytest.fixture(scope="module")
def gpu_llama_bf16_path(tmp_path_factory):
    """Stored in bfloat16, so that transformers and we quantize the very same weights."""
    return make_gpu_llama(tmp_path_factory.mktemp("gpu-llama-bf16"), torch.bfloat16)


def hf_model(path, dtype=torch.float32, quantization_config=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"quantization_config": quantization_config, "device_map": {"": 0}} if quantization_config else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    return model if quantization_config else model.to("cuda")


def greedy(model, n=24, prompt=PROMPT):
    ids = torch.tensor([prompt], device="cuda")
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[0].tolist()


def test_local_ranges_float32_equal_hf_with_graphs(gpu_llama_path):
    from petals_chain.client.model import DistributedModelForCausalLM

    ref = greedy(hf_model(gpu_llama_path))
    model = DistributedModelForCausalLM.from_local_ranges(gpu_llama_path, [(0, 2), (2, 6)], device="cuda")
    assert greedy(model) == ref
    graphs = model.backend.ranges[0].graphs
    assert graphs.captures >= 1 and graphs.replays >= 10  # the decode steps really replayed graphs
    # multi-turn: a second generate continues the session (a multi-token step after a prefix: the mask path)
    with model.inference_session(max_length=80) as session:
        first = model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=6, do_sample=False, pad_token_id=0)
        follow = torch.tensor([[9, 10, 11, 12, 13]], device="cuda")
        second = model.generate(follow, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert session.position == second.shape[1] - 1
    assert second[0].tolist() == greedy(hf_model(gpu_llama_path), 8, first[0].tolist() + follow[0].tolist())


def test_bfloat16_logits_within_tolerance(gpu_llama_path):
    from petals_chain.client.model import DistributedModelForCausalLM

    ids = torch.tensor([PROMPT], device="cuda")
    hf = hf_model(gpu_llama_path, torch.bfloat16)
    model = DistributedModelForCausalLM.from_local_ranges(
        gpu_llama_path, [(0, 3), (3, 6)], dtype="bfloat16", device="cuda"
    )
    ref = hf(ids).logits.float()
    ours = model(ids).logits.float()
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 0.02 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_long_bfloat16_prompt_finite_and_close_to_hf(gpu_llama_path):
    """A prompt near the context (the GPU variant's prompts are up to 4,096 tokens) through two ranges."""
    from petals_chain.client.model import DistributedModelForCausalLM

    ids = torch.randint(2, 512, (1, 1000), generator=torch.Generator().manual_seed(1)).to("cuda")
    hf = hf_model(gpu_llama_path, torch.bfloat16)
    model = DistributedModelForCausalLM.from_local_ranges(
        gpu_llama_path, [(0, 3), (3, 6)], dtype="bfloat16", device="cuda"
    )
    ref, ours = hf(ids).logits.float(), model(ids).logits.float()
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_quantized_equals_hf_same_bitsandbytes_config(gpu_llama_bf16_path, quant):
    from transformers import BitsAndBytesConfig

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.runtime.quantization import module_bytes

    if quant == "nf4":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
            llm_int8_skip_modules=["lm_head"],
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_skip_modules=["lm_head"])
    hf = hf_model(gpu_llama_bf16_path, torch.bfloat16, config)
    model = DistributedModelForCausalLM.from_local_ranges(
        gpu_llama_bf16_path, [(0, 6)], dtype="bfloat16", quant=quant, device="cuda"
    )
    ids = torch.tensor([PROMPT], device="cuda")
    ref, ours = hf(ids).logits.float(), model(ids).logits.float()
    assert (ours - ref).abs().max() <= 0.02 * ref.abs().max(), ((ours - ref).abs().max(), ref.abs().max())
    # decode steps too (a quantized range decodes eagerly: bitsandbytes' kernels are not graph-capturable)
    assert greedy(model, 12) == greedy(hf, 12)
    block_range = model.backend.ranges[0]
    dense = 2 * sum(p.numel() for n, p in hf.model.layers[0].named_parameters() if "proj" in n)
    # the weights really are quantized: a block takes well under its bf16 size
    assert module_bytes(block_range.blocks[0]) < 0.6 * dense  # measured: int8 ~0.5, nf4 0.52 (tiny layers: bookkeeping)


def test_swarm_on_cuda_equals_hf_with_multi_turn_and_prefix_hits(gpu_llama_path):
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.swarm.local import LocalSwarm

    hf = hf_model(gpu_llama_path)
    args = ["--device", "cuda", "--memory-budget", "2GiB", "--max-length", "512"]
    with LocalSwarm(str(gpu_llama_path), [(0, 3), (3, 6)], server_args=args) as swarm:
        client = DistributedModelForCausalLM.from_pretrained(
            gpu_llama_path, initial_peers=swarm.initial_peers, device="cuda"
        )
        try:
            long_prompt = PROMPT * 4  # 48 tokens: three 16-token chunks for the prefix cache
            for _ in range(2):  # the second run hits the first one's prefix on both hops
                assert greedy(client, 16, long_prompt) == greedy(hf, 16, long_prompt)
            with client.inference_session(max_length=128):
                first = client.generate(
                    torch.tensor([PROMPT], device="cuda"), max_new_tokens=5, do_sample=False, pad_token_id=0
                )
                follow = torch.tensor([[21, 22, 23]], device="cuda")
                second = client.generate(follow, max_new_tokens=7, do_sample=False, pad_token_id=0)
            assert second[0].tolist() == greedy(hf, 7, first[0].tolist() + follow[0].tolist())
        finally:
            client.backend.shutdown()


MPS_CLIENT = """
import torch
x = torch.randn(1024, 1024, device="cuda")
torch.cuda.synchronize()
print(float((x @ x).sum().item() == (x @ x).sum().item()))
"""


def test_mps_daemon_serves_the_processes_given_its_environment():
    """experiments/gpu_mps.py with the real control program: a process with the yielded environment makes
    its CUDA context through the daemon (an MPS server appears), and the daemon is gone after the block."""
    from experiments.gpu_mps import find_control, mps_daemon, server_list

    binary = find_control()
    if binary is None:
        pytest.skip("nvidia-cuda-mps-control is not installed on this GPU host")
    with mps_daemon(50) as env:
        done = subprocess.run(
            [sys.executable, "-c", MPS_CLIENT], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert server_list(env), "no MPS server: the client did not connect through the daemon"
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert not os.path.exists(pipe)


def test_exactness_tests_pass_under_mps():
    """`experiment table1 --gpu-isolation mps` on an H200 (docs/results.md; Llama-2-7B shape, bfloat16, each process
    capped at 33 % of the SMs) saw hidden states with NaN or Inf in 54 of 60 requests, never without MPS; the
    cause is not known. This runs this file's exactness tests in a process that reaches the GPU through an
    MPS daemon with that cap: a failure here puts the fault in the blocks' kernels under MPS."""
    from experiments.gpu_mps import find_control, mps_daemon

    if os.environ.get("PETALS_CHAIN_UNDER_MPS"):
        pytest.skip("already running under MPS")
    if find_control() is None:
        pytest.skip("nvidia-cuda-mps-control is not installed on this GPU host")
    with mps_daemon(100 / 3) as env:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                __file__,
                "-k",
                "local_ranges or bfloat16 or swarm_on_cuda",
            ],
            env={**os.environ, **env, "PETALS_CHAIN_UNDER_MPS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stdout[-4000:]
