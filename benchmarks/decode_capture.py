"""Does the fast decode's step capture as a CUDA graph at a given shape, and how fast is it under each
attention backend? Prints one JSON line per variant (and the traceback of a failed capture).

    python benchmarks/decode_capture.py --shape qwen2.5-0.5b --dtype bfloat16 --batch 128 --new-tokens 256

Variants: the model's default attention (sdpa, every backend allowed), sdpa without cuDNN, sdpa with
the math backend only, and HF's eager attention. For each: whether `ModelGenerate(decode="fast")`
held a CUDA graph after its call, the warnings it raised, and tokens/s of a second (timed) call.
Then the two halves of a step (the token picker alone, the model's decode forward alone) are captured
directly, so a failure names its half.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@contextlib.contextmanager
def sdpa_backends(cudnn: bool = True, flash: bool = True, efficient: bool = True):
    import torch

    saved = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
             torch.backends.cuda.mem_efficient_sdp_enabled())
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.backends.cuda.enable_flash_sdp(flash)
    torch.backends.cuda.enable_mem_efficient_sdp(efficient)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved[0])
        torch.backends.cuda.enable_flash_sdp(saved[1])
        torch.backends.cuda.enable_mem_efficient_sdp(saved[2])


def variant(model, tok, batch: int, new_tokens: int) -> dict:
    import torch
    from generation import rollouts

    from SimpleTorchLLMRL.model.generation.fast_decode import DECODERS
    from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

    gen = ModelGenerate(model, tok, seed=0,
                        sampling=SamplingConfig(max_new_tokens=new_tokens, temperature=1.0,
                                                eos_token_ids=[model.config.vocab_size - 1]),
                        backend=BackendConfig(decode="fast"))
    rs = rollouts(batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen.generate(rs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        groups = gen.generate(rs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    held = DECODERS.get(model)
    out = {"graph": held is not None and held[1].graph is not None,
           "tokens_per_s": sum(len(g[0].token_ids) for g in groups) / seconds,
           "warnings": [str(w.message)[:600] for w in caught if "tokenizer has only" not in str(w.message)]}
    gen.sleep()
    return out


def capture_halves(model, batch: int) -> dict:
    """Capture the picker alone and the decode forward alone; the traceback of whichever fails."""
    import torch

    from SimpleTorchLLMRL.model.generation.fast_decode import StaticDecoder
    from SimpleTorchLLMRL.model.generation.picker import TokenPicker
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

    out = {}
    V = model.config.vocab_size
    pick = TokenPicker(SamplingConfig(temperature=1.0)).pick
    scores = torch.randn(batch, V, device="cuda")
    dec = StaticDecoder(model, batch, 128, torch.device("cuda"), graphs=False, pick=pick, eos_ids=(V - 1,))
    ids = torch.randint(0, V, (batch, 16), device="cuda")
    with torch.inference_mode():
        dec._prefill(ids, torch.ones_like(ids))
        for name, fn in (("picker", lambda: pick(scores)), ("step", dec._step)):
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                g.replay()
                torch.cuda.synchronize()
                out[name] = "captured"
            except Exception:  # noqa: BLE001  (the point is to see it)
                out[name] = traceback.format_exc()[-4000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "qwen2.5-0.5b"], default="qwen2.5-0.5b")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import torch
    from generation import build

    if not torch.cuda.is_available():
        print("decode_capture.py: CUDA is not available, nothing measured.")
        return
    model, tok = build(a.shape, a.dtype, "cuda")
    res = {"shape": a.shape, "dtype": a.dtype, "batch": a.batch, "new_tokens": a.new_tokens,
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "variants": {}}
    res["halves"] = capture_halves(model, a.batch)
    print(json.dumps({"halves": {k: v[-1500:] for k, v in res["halves"].items()}}), flush=True)
    for name, ctx in (("sdpa", contextlib.nullcontext()), ("sdpa_no_cudnn", sdpa_backends(cudnn=False)),
                      ("sdpa_math", sdpa_backends(False, False, False))):
        with ctx:
            res["variants"][name] = variant(model, tok, a.batch, a.new_tokens)
        print(json.dumps({name: res["variants"][name]}), flush=True)
    model.set_attn_implementation("eager")
    res["variants"]["eager_attention"] = variant(model, tok, a.batch, a.new_tokens)
    print(json.dumps({"eager_attention": res["variants"]["eager_attention"]}), flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
