"""No host sync from the forward's start to the backward's end, and a head whose op count grows slowly.

A step on a GPU is bound by the CPU launching kernels; every op that makes the host wait for the
device (`.item()`, `nonzero`, a boolean-mask index, `allclose`, `equal`) drains the queue. A
`TorchDispatchMode` sees every op on CPU as it would on CUDA, so these tests count them here:

- around `calculate_loss(prepared)` + `backward()` for GRPO (every loss_type, both head paths, the
  kernels that run on CPU) and PPO: zero;
- around the seed call `calculate_loss(rollouts, rewards)` + `backward()`, from the training
  forward's first op on (encoding and the checks on host data come before it): zero;
- packed (`packed=True`: the rows' layout found by prepare / split) and padded batches of every front,
  with lengths rounded up (`length_buckets`): zero;
- the metrics are still numbers once read after backward, and equal the loss;
- the two-pass head's ops grow by a small constant per extra chunk (the fused one's loss graph
  per chunk was ~85 ops; `head_impl="gpu"`, the path CUDA takes).
"""

import contextlib
import json
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.losses import LazyMetrics, combine_metrics
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy
from SimpleTorchLLMRL.trainer.ppo import PPO
from tests.support.losses_helpers import make_rollouts, perturbed_copy, with_sampled_logprobs

SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "allclose", "equal", "is_nonzero", "masked_select"}
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}  # a bool index is a nonzero inside
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
IMPLS = ["cpu", "gpu"] + (["triton"] if head_triton.interpreting() else [])
OFF_POLICY = {"icepop": OffPolicy.icepop(0.8, 1.25), "sequence_truncate": OffPolicy("sequence", "truncate", high=2.0),
              "geometric_mask": OffPolicy.geometric_mask(0.9, 1.1),
              "token_reject_deepseek": OffPolicy("token", "reject", 0.8, 1.25, kl_threshold=0.01)}
OPS_PER_EXTRA_CHUNK = 45  # measured 39 (two GEMMs of pass 1 and 2 each, the softmax and gradient passes, views)


class SyncCounter(TorchDispatchMode):
    """Counts every op, and records the ones that wait for the device (with where they were called)."""

    def __init__(self, armed: bool = True):
        super().__init__()
        self.armed, self.ops, self.syncs = armed, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.armed:
            self.ops += 1
            name = func.overloadpacket.__name__
            indices = args[1] if name in BOOL_INDEXED and len(args) > 1 else ()
            boolean = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))
            if name in SYNC_OPS or boolean:
                self.syncs.append(f"{func}:\n{''.join(traceback.format_stack(limit=8)[:-2])}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_from_training_forward(model):
    """A SyncCounter that starts counting at the first op of the model's first forward with grad enabled
    (the loss's own): encoding and the host-side checks before it are not counted."""
    counter = SyncCounter(armed=False)

    def hook(module, args, kwargs):
        if torch.is_grad_enabled():
            counter.armed = True

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with counter:
            yield counter
    finally:
        handle.remove()


def assert_no_sync(counter: SyncCounter) -> None:
    assert counter.ops > 0, "nothing was counted"
    assert not counter.syncs, f"{len(counter.syncs)} host syncs, the first at {counter.syncs[0]}"


@pytest.fixture
def setup(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0, shift=0.3)
    return model, tok, rollouts


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fused", [None, True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_grpo_loss_and_backward_wait_for_nothing(loss_type, fused, impl, setup):
    model, tok, rollouts = setup
    grpo = GRPO(model, tok, beta=0.1, ref_model=perturbed_copy(model), loss_type=loss_type, group_size=3,
                max_tokens=40, off_policy=OffPolicy.tis(2.0), fused=fused, head_impl=impl, chunk_size=8)
    prepared = grpo.prepare(rollouts, REWARDS)
    grpo.calculate_loss(prepared).backward()  # the once-per-model checks (the head's logits) run here
    model.zero_grad()
    with SyncCounter() as counter:
        loss = grpo.calculate_loss(prepared)
        loss.backward()
    assert_no_sync(counter)
    metrics = grpo.metrics  # read after backward: numbers now
    assert isinstance(metrics["loss"], float) and metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert isinstance(metrics["num_tokens"], int) and metrics["num_tokens"] == int(prepared.mask[:, 1:].sum())
    assert 0 <= metrics["clip_frac"] <= 1 and metrics["kl"] >= 0 and metrics["tis_weight_mean"] <= 2.0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("name", list(OFF_POLICY))
def test_off_policy_correction_and_its_metrics_wait_for_nothing(name, fused, impl, setup):
    """Every off-policy option on, GRPO (prepared, then micro-batches) and PPO: zero syncs, metrics read after."""
    model, tok, rollouts = setup
    grpo = GRPO(model, tok, group_size=3, off_policy=OFF_POLICY[name], fused=fused, head_impl=impl, chunk_size=8)
    ppo = PPO(model, tok, off_policy=OFF_POLICY[name], head_impl=impl, chunk_size=8)
    prepared, ppo_prepared = grpo.prepare(rollouts, REWARDS), ppo.prepare(rollouts, REWARDS)
    parts = prepared.split(3)
    grpo.calculate_loss(prepared).backward()  # the once-per-model checks run here
    model.zero_grad()
    with SyncCounter() as counter:
        full = grpo.compute(prepared)
        full.loss.backward()
        outs = [grpo.compute(mb) for mb in parts]
        for out in outs:
            out.loss.backward()
        ppo.calculate_loss(ppo_prepared).backward()
    assert_no_sync(counter)
    metrics = full.metrics  # read after backward: numbers now
    assert metrics["loss"] == pytest.approx(float(full.loss.detach()), rel=1e-6)
    assert metrics["offpolicy_kl_k3"] > 0 and 0 < metrics["offpolicy_ess"] <= 1 + 1e-6 and metrics["tis_weight_mean"] >= 0
    assert 0 <= ppo.metrics["offpolicy_masked_frac"] <= 1 and ppo.metrics["offpolicy_kl_k3"] > 0
    combined = combine_metrics([o.metrics for o in outs])
    for key in ("loss", "offpolicy_kl_k1", "offpolicy_chi2_seq", "offpolicy_ess", "offpolicy_masked_frac"):
        assert combined[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("impl", IMPLS)
def test_the_seed_call_waits_for_nothing_once_the_forward_starts(impl, setup):
    """`calculate_loss(rollouts, rewards)`: encoding and the data checks run on host data first."""
    model, tok, rollouts = setup
    grpo = GRPO(model, tok, group_size=3, head_impl=impl)
    grpo.calculate_loss(rollouts, REWARDS).backward()
    model.zero_grad()
    with counting_from_training_forward(model) as counter:
        grpo.calculate_loss(rollouts, REWARDS).backward()
    assert_no_sync(counter)


@pytest.mark.parametrize("share_prefix", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_micro_batches_wait_for_nothing_and_combine_to_the_full_batch(impl, share_prefix, setup):
    """Also with each group's prompt run once (`share_prefix`: its plan is found by prepare / split)."""
    model, tok, rollouts = setup
    grpo = GRPO(model, tok, group_size=3, head_impl=impl, chunk_size=8, share_prefix=share_prefix)
    prepared = grpo.prepare(rollouts, REWARDS)
    full = grpo.compute(prepared)
    full.loss.backward()
    parts = prepared.split(3)  # token indices and shared prefixes are found here, before any forward
    assert all((p.prefix_plan is not None) == share_prefix for p in parts)
    assert not share_prefix or all(p.prefix_plan.group is not None for p in parts)  # a group of 3 shares
    with SyncCounter() as counter:
        outs = [grpo.compute(mb) for mb in parts]
        for out in outs:
            out.loss.backward()
    assert_no_sync(counter)
    combined = combine_metrics([o.metrics for o in outs])
    for key in ("loss", "entropy", "ratio_mean", "ratio_min", "ratio_max", "clip_frac", "num_tokens"):
        assert combined[key] == pytest.approx(full.metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("impl", IMPLS)
def test_ppo_loss_and_backward_wait_for_nothing(impl, setup):
    model, tok, rollouts = setup
    ppo = PPO(model, tok, beta=0.05, ref_model=perturbed_copy(model), off_policy=OffPolicy.tis(2.0), head_impl=impl,
              chunk_size=8)
    prepared = ppo.prepare(rollouts, REWARDS)
    ppo.calculate_loss(prepared).backward()
    model.zero_grad()
    with SyncCounter() as counter:
        loss = ppo.calculate_loss(prepared)
        loss.backward()
    assert_no_sync(counter)
    assert ppo.metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert ppo.metrics["num_tokens"] == int(prepared.mask.sum())
    on_policy = PPO(model, tok, head_impl=impl)  # advantages from the values inside compute
    with counting_from_training_forward(model) as counter:
        on_policy.calculate_loss(rollouts, REWARDS).backward()
    assert_no_sync(counter)


@pytest.mark.parametrize("length_buckets", [None, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_packed_and_padded_batches_of_every_front_wait_for_nothing(packed, length_buckets, setup):
    """Packed rows (their layout found by prepare / split, the block mask built on the device) and padded ones,
    with rounded-up lengths, for GRPO (micro-batches too), PPO, SFT, DPO and Distill's JSD."""
    from SimpleTorchLLMRL.trainer.distill import Distill
    from SimpleTorchLLMRL.trainer.dpo import DPO
    from SimpleTorchLLMRL.trainer.sft import SFT

    model, tok, rollouts = setup
    opts = dict(packed=packed, length_buckets=length_buckets, chunk_size=8)
    ref = perturbed_copy(model)
    fronts = [(GRPO(model, tok, group_size=3, beta=0.1, ref_model=ref, **opts), (rollouts, REWARDS)),
              (PPO(model, tok, **opts), (rollouts, REWARDS)), (SFT(model, tok, **opts), (rollouts,)),
              (DPO(model, tok, ref_model=ref, **opts), ([rollouts[0], rollouts[3]], [rollouts[1], rollouts[5]])),
              (Distill(model, tok, teacher=ref, divergence="jsd", **opts), (rollouts,))]
    # (reverse-KL Distill is left out: `distill_loss` checks its teacher log-probs for NaN with a host sync)
    prepared = [(front, front.prepare(*args)) for front, args in fronts]
    assert all((tb.pack_plan is not None) == packed for _, tb in prepared)
    parts = prepared[0][1].split(4)
    for front, tb in prepared:  # the once-per-model checks (the head's logits, the packed forward) run here
        front.compute(tb).loss.backward()
    model.zero_grad()
    with SyncCounter() as counter:
        for front, tb in prepared:
            front.compute(tb).loss.backward()
        for part in parts:
            prepared[0][0].compute(part).loss.backward()
    assert_no_sync(counter)
    model.zero_grad()


@pytest.mark.parametrize("impl", ["gpu"])  # "triton" in the interpreter: its launches run torch ops of their own
def test_the_two_pass_heads_ops_grow_by_a_small_constant_per_chunk(impl, setup):
    model, tok, rollouts = setup
    ops = {}
    for chunk in (1000, 8):
        grpo = GRPO(model, tok, group_size=3, head_impl=impl, chunk_size=chunk)
        prepared = grpo.prepare(rollouts, REWARDS)
        grpo.calculate_loss(prepared).backward()
        with SyncCounter() as counter:
            grpo.calculate_loss(prepared).backward()
        ops[chunk] = counter.ops
    n = int(prepared.mask[:, 1:].sum())
    extra_chunks = -(-n // 8) - 1
    assert extra_chunks >= 5
    assert (ops[8] - ops[1000]) / extra_chunks <= OPS_PER_EXTRA_CHUNK, ops


def test_lazy_metrics_materialize_once_into_numbers():
    m = LazyMetrics(loss=torch.tensor(1.5), num_tokens=torch.tensor(3), num_sequences=2)
    merged = LazyMetrics.merged({"reward_mean": 0.5}, m, temperature=0.7)
    assert isinstance(dict.__getitem__(merged, "loss"), torch.Tensor)  # nothing read yet
    assert {**merged} == {"reward_mean": 0.5, "loss": 1.5, "num_tokens": 3, "num_sequences": 2, "temperature": 0.7}
    assert type(merged["num_tokens"]) is int and type(merged["loss"]) is float
    assert json.loads(json.dumps(merged))["loss"] == 1.5
    assert dict(m) == {"loss": 1.5, "num_tokens": 3, "num_sequences": 2}
