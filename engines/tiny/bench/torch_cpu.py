"""PyTorch CPU (transformers) on a tiny model folder, for the side-by-side comparison of
engines/tiny/bench_torch_test.go, which runs it and prints the ratios:

    python torch_cpu.py DIR gen BATCH PROMPT NEW SEED   # sampled tok/s
    python torch_cpu.py DIR train BATCH PROMPT RESPONSE SEED   # trained-sequence tok/s

One JSON object on stdout per call. The model is read in float32 and runs with as many threads as
the Go side (SLIMEN_BENCH_THREADS, default all cores). Generation samples at temperature 1 with
EOS suppressed (min_new_tokens), so every row produces NEW tokens; the time counts prefill and
decode. Training is one step of the engine's default policy loss at ratio 1 (old log-probs equal
to the current ones): −advantage · ratio averaged over the response tokens, then AdamW (lr 1e-3,
gradient clipping at 1), the same work per token as the engine's Train.
"""

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def prompts(batch, length, vocab, seed):
    # The same tokens as benchPrompt in bench_torch_test.go.
    return torch.tensor([[2 + (i * 7 + j * 13 + seed) % (vocab - 2) for j in range(length)] for i in range(batch)])


def gen(model, batch, plen, new, seed):
    ids = prompts(batch, plen, model.config.vocab_size, seed)
    torch.manual_seed(seed)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                         top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    dt = time.perf_counter() - t
    n = (out.shape[1] - plen) * batch
    return {"tok_s": n / dt, "tokens": n, "seconds": dt}


def train(model, batch, plen, rlen, seed):
    ids = prompts(batch, plen + rlen, model.config.vocab_size, seed)
    adv = torch.tensor([float(i % 3 - 1) for i in range(batch)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    t = time.perf_counter()
    # The engine feeds prompt + response[:-1] and predicts the response tokens.
    logits = model(ids[:, :-1]).logits[:, plen - 1:, :]
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, plen:, None]).squeeze(-1)
    ratio = torch.exp(lp - lp.detach())
    loss = (-adv[:, None] * ratio).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    dt = time.perf_counter() - t
    n = batch * (plen + rlen - 1)
    return {"tok_s": n / dt, "tokens": n, "seconds": dt, "loss": loss.item()}


def main():
    d, mode, batch, a, b, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    torch.set_num_threads(int(os.environ.get("SLIMEN_BENCH_THREADS", "0")) or os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    # Each measurement follows a smaller warm-up call of the same kind: first calls allocate and
    # pick kernels.
    if mode == "gen":
        model.eval()
        with torch.no_grad():
            gen(model, batch, a, 2, seed + 1)
            r = gen(model, batch, a, b, seed)
    elif mode == "train":
        model.train()
        train(model, min(batch, 8), a, b, seed + 1)
        r = train(model, batch, a, b, seed)
    else:
        raise SystemExit(f"torch_cpu.py: unknown mode {mode!r} (gen or train)")
    r["threads"] = torch.get_num_threads()
    print(json.dumps(r))


if __name__ == "__main__":
    main()
