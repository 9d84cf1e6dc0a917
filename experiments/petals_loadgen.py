"""The Table 1 load generator for real PETALS 2.2 (runs with PETALS' own Python environment).

Same requests, same prompts (seeded token ids), same records as `experiments.loadgen`, through
PETALS' client: one `inference_session` per request over PETALS' own routing, a prefill step of
exactly `input_tokens`, then exactly `output_tokens - 1` greedy decode steps. PETALS has no central
queue: a session waits inside the servers for cache, so its start is not observable: `start_s` stays
null and the summary shows response times only for this column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from experiments.loadgen import RECORD_FIELDS, Replayer, prompt_ids


class PetalsReplayer(Replayer):
    def run_one(self, req: dict) -> None:
        import torch

        rec = {k: None for k in RECORD_FIELDS}
        rec.update(
            index=req["index"],
            policy="petals-2.2",
            arrival_s=req["arrival_s"],
            input_tokens=req["input_tokens"],
            output_tokens=req["output_tokens"],
            generated_tokens=0,
            submitted_s=self.clock() - self.t0,
            chain="petals routing",
        )
        m = self.model
        ids = torch.tensor(
            [prompt_ids(np.random.default_rng([self.seed, req["index"]]), req["input_tokens"], m.config.vocab_size)]
        )
        try:
            with (
                torch.inference_mode(),
                m.model.layers.inference_session(max_length=req["input_tokens"] + req["output_tokens"]) as sess,
            ):
                hidden = sess.step(m.model.embed_tokens(ids))
                token = int(m.lm_head(m.model.norm(hidden[:, -1:])).argmax(-1))
                rec["first_token_s"] = self.clock() - self.t0
                rec["generated_tokens"] = 1
                for _ in range(req["output_tokens"] - 1):
                    hidden = sess.step(m.model.embed_tokens(torch.tensor([[token]])))
                    token = int(m.lm_head(m.model.norm(hidden[:, -1:])).argmax(-1))
                    rec["generated_tokens"] += 1
        except Exception as e:  # noqa: BLE001 - every failure is recorded with its error, none is lost
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["end_s"] = self.clock() - self.t0
        self.write(rec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.petals_loadgen", description=__doc__)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--model", required=True, help="the converted checkpoint folder PETALS' servers serve")
    p.add_argument("--dht-prefix", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=600.0)
    args = p.parse_args(argv)
    import torch
    from petals import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    requests = json.loads(Path(args.requests).read_text())
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix, torch_dtype=torch.float32
    )
    print(f"loadgen: replaying {len(requests)} requests (petals-2.2)", flush=True)
    late = PetalsReplayer(model, requests, "petals-2.2", Path(args.out), args.seed).replay(args.deadline)
    print(f"loadgen: done ({late} not finished by the deadline)", flush=True)
    os._exit(0)  # PETALS 2.2's client can hang in its own shutdown (seen with ../shared/anchors): records are written


if __name__ == "__main__":
    sys.exit(main())
