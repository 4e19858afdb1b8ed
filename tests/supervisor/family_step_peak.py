"""One training step's peak memory of a saved model on CPU, in a fresh process (run as a script).

    python tests/supervisor/family_step_peak.py SEQ_LEN MICRO_BATCH MODEL_DIR [MODEL_DIR ...]

Prints one JSON line per model, one model after the other (the peak is reset for each): the bytes
of the live weights, gradients and AdamW states (exact, from the tensors), and `step_bytes` (the
measured step's peak RSS above them, VmHWM reset through /proc/self/clear_refs), measured as
bench/memory_model.py (b) does: fp32, one thread, eager attention, Hugging Face's labels loss,
gradients kept (zero_grad(set_to_none=False)). Run it with MALLOC_MMAP_THRESHOLD_=65536 so that RSS
follows the live tensors.
"""

from __future__ import annotations

import gc
import json
import sys


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def main(model_dir: str, seq_len: int, micro_batch: int) -> dict[str, int]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rss0 = _status("VmRSS:")
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.get_input_embeddings().weight.shape[0]

    def step(b: int, s: int) -> None:
        ids = torch.randint(0, vocab, (b, s))
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    step(1, 8)
    gc.collect()
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step(micro_batch, seq_len)
    step_bytes = _status("VmHWM:") - base
    params = list(model.parameters())
    opt_state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"step_bytes": step_bytes, "states_rss_bytes": base - rss0, "num_parameters": model.num_parameters(),
            "weights_bytes": sum(p.numel() * p.element_size() for p in params),
            "gradients_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in opt_state)}


if __name__ == "__main__":
    for model_dir in sys.argv[3:]:
        print(json.dumps({"model_dir": model_dir, **main(model_dir, int(sys.argv[1]), int(sys.argv[2]))}), flush=True)
        gc.collect()
