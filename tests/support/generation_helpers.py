"""Helpers shared by the generation tests: a prompt-sensitive tiny model and a float64 log-prob reference."""

import torch


def peaked(model, seed=0, std=0.15):
    """Re-init the matrices with a larger scale so greedy outputs depend on the prompt (no near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def reference_logprobs(model, prompt, ids, temperature):
    """Fresh float64 forward over prompt + ids: log_softmax(logits / T) at each sampled id, shape (len(ids),)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].double()  # (T, V)
    lp = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1)
    return lp[pos, torch.tensor(ids)]


def make_generator(model, tok, *, seed=None, decode="auto", batch_size=None, sampling=None, **options):
    """`ModelGenerate` with any `SamplingConfig` field as a keyword (the tests' shorthand): the options go into
    one SamplingConfig (or `sampling` as given), decode / batch_size into the BackendConfig."""
    from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

    if sampling is None:
        sampling = SamplingConfig(**options)
    elif options:
        raise ValueError(f"give sampling= or the options {sorted(options)}, not both")
    return ModelGenerate(model, tok, sampling=sampling, seed=seed,
                         backend=BackendConfig(decode=decode, batch_size=batch_size))
