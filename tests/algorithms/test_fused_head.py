"""log_probs_from_hidden: the fused LM head against logits computed whole and fed to
log_probs_from_logits / entropy_from_logits, in values and in gradients (hidden, weight, bias)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightrft.algorithms.fused_head import log_probs_from_hidden
from lightrft.algorithms.logprobs import entropy_from_logits, log_probs_from_logits

F64 = torch.float64
N, H, V = 13, 6, 29  # 13 rows: chunks of 4 and 5 leave a remainder, 64 is more than all of them


def inputs(seed, dtype=F64, bias=True, rows=N):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, H, generator=gen, dtype=F64)
    weight = 0.8 * torch.randn(V, H, generator=gen, dtype=F64)
    b = torch.randn(V, generator=gen, dtype=F64) if bias else None
    labels = torch.randint(0, V, (rows,), generator=gen)
    upstream = torch.randn(2, rows, generator=gen, dtype=F64)  # weights of the log-probs and entropies in the loss
    cast = [t.to(dtype).requires_grad_(True) if t is not None else None for t in (hidden, weight, b)]
    return (*cast, labels, upstream)


def plain(hidden, weight, bias, labels, temperature=1.0, softcap=None, banned=None):
    """The route the fused head replaces: whole logits, transformed, then logprobs.py."""
    logits = F.linear(hidden, weight, bias)  # (N, V)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if banned is not None:
        logits = logits.index_fill(-1, banned, -1e9)
    return log_probs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)


def loss_and_grads(log_probs, entropy, upstream, params):
    """A loss weighting every row's log-prob and entropy differently, and its gradients."""
    loss = (log_probs * upstream[0].to(log_probs.dtype)).sum()
    if entropy is not None:
        loss = loss + (entropy * upstream[1].to(entropy.dtype)).sum()
    return torch.autograd.grad(loss, [p for p in params if p is not None])


CASES = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.7),
    "softcap": dict(temperature=1.3, softcap=2.5),
    "banned": dict(temperature=0.7, banned=torch.tensor([3, 11, 28])),
    "all": dict(temperature=1.3, softcap=2.5, banned=torch.tensor([0, 7])),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk_tokens", [1, 4, 5, 64])
@pytest.mark.parametrize("want", ["log_probs", "entropy", "both"])
def test_float64_equals_whole_logits_values_and_gradients(case, chunk_tokens, want):
    options = CASES[case]
    hidden, weight, bias, labels, upstream = inputs(seed=chunk_tokens)
    if "banned" in options:
        labels[2] = options["banned"][0]  # a banned label: log p = -1e9 / T - logsumexp, gradient 0 at it
    ours_lp, ours_h = log_probs_from_hidden(hidden, weight, labels, bias, temperature=options["temperature"],
                                            softcap=options.get("softcap"), banned_ids=options.get("banned"),
                                            return_entropy=want != "log_probs", chunk_tokens=chunk_tokens)
    ref_lp, ref_h = plain(hidden, weight, bias, labels, options["temperature"], options.get("softcap"),
                          options.get("banned"))
    assert ours_lp.dtype == F64 and ours_lp.shape == (N,)
    torch.testing.assert_close(ours_lp, ref_lp, atol=1e-10, rtol=0)
    if want == "log_probs":
        assert ours_h is None
    else:
        torch.testing.assert_close(ours_h, ref_h, atol=1e-10, rtol=0)
    scale = {"log_probs": (1, 0), "entropy": (0, 1), "both": (1, 1)}[want]
    weights = upstream * torch.tensor(scale, dtype=F64).unsqueeze(1)
    ours = loss_and_grads(ours_lp, ours_h, weights, (hidden, weight, bias))
    ref = loss_and_grads(ref_lp, ref_h if want != "log_probs" else None, weights, (hidden, weight, bias))
    for name, got, expected in zip(("hidden", "weight", "bias"), ours, ref):
        assert expected.abs().max() > 1e-3, f"the {name} gradient of the reference is ~0: the check would be empty"
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0, msg=f"gradient of {name}")


def test_hand_computed_log_prob_and_entropy():
    # One row, H = 1: logits [0, 1, 2] / T with T = 2 -> z = [0, 0.5, 1].
    hidden = torch.tensor([[1.0]], dtype=F64, requires_grad=True)
    weight = torch.tensor([[0.0], [1.0], [2.0]], dtype=F64, requires_grad=True)
    log_probs, entropy = log_probs_from_hidden(hidden, weight, torch.tensor([2]), temperature=2.0,
                                               return_entropy=True)
    z = [0.0, 0.5, 1.0]
    log_norm = math.log(sum(math.exp(v) for v in z))
    p = [math.exp(v - log_norm) for v in z]
    assert log_probs.item() == pytest.approx(1.0 - log_norm, abs=1e-12)
    assert entropy.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-12)
    log_probs.sum().backward()
    # d log p(2) / d hidden = (1/T) * sum_k (1[k=2] - p_k) w_k = (2 - (p_1 + 2 p_2)) / 2
    assert hidden.grad.item() == pytest.approx((2.0 - (p[1] + 2 * p[2])) / 2, abs=1e-12)
    # d log p(2) / d w_k = (1[k=2] - p_k) * hidden / T
    expected_weight = [((k == 2) - p[k]) / 2 for k in range(3)]
    assert weight.grad.flatten().tolist() == pytest.approx(expected_weight, abs=1e-12)


@pytest.mark.parametrize("case", ["temperature", "all"])
def test_float32_inputs_match_float64_within_float32_rounding(case):
    options = CASES[case]
    hidden, weight, bias, labels, upstream = inputs(seed=3, dtype=torch.float32)
    kwargs = dict(temperature=options["temperature"], softcap=options.get("softcap"),
                  banned_ids=options.get("banned"), return_entropy=True, chunk_tokens=5)
    ours_lp, ours_h = log_probs_from_hidden(hidden, weight, labels, bias, **kwargs)
    assert ours_lp.dtype == ours_h.dtype == torch.float32
    ref_params = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    ref_lp, ref_h = plain(*ref_params, labels, options["temperature"], options.get("softcap"), options.get("banned"))
    torch.testing.assert_close(ours_lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ours_h.double(), ref_h, atol=2e-5, rtol=1e-5)
    for got, expected in zip(loss_and_grads(ours_lp, ours_h, upstream, (hidden, weight, bias)),
                             loss_and_grads(ref_lp, ref_h, upstream, ref_params)):
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


def test_bf16_inputs_compute_in_float32_and_match_the_bf16_route():
    hidden, weight, bias, labels, upstream = inputs(seed=4, dtype=torch.bfloat16)
    ours_lp, ours_h = log_probs_from_hidden(hidden, weight, labels, bias, temperature=0.7, softcap=2.5,
                                            return_entropy=True, chunk_tokens=4)
    assert ours_lp.dtype == ours_h.dtype == torch.float32
    ours = loss_and_grads(ours_lp, ours_h, upstream, (hidden, weight, bias))
    assert [g.dtype for g in ours] == [torch.bfloat16] * 3
    # The plain route with the same bf16 logits (its soft-cap in bf16 too, as the model's head does it).
    ref_lp, ref_h = plain(hidden, weight, bias, labels, 0.7, 2.5)
    torch.testing.assert_close(ours_lp, ref_lp, atol=0.05, rtol=0.02)
    torch.testing.assert_close(ours_h, ref_h, atol=0.05, rtol=0.02)
    # And both within bf16 rounding of the float64 truth.
    exact = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    exact_lp, exact_h = plain(*exact, labels, 0.7, 2.5)
    torch.testing.assert_close(ours_lp.double(), exact_lp, atol=0.03, rtol=0.01)
    for got, expected in zip(ours, loss_and_grads(exact_lp, exact_h, upstream, exact)):
        scale = expected.abs().max()
        assert (got.double() - expected).abs().max() < 0.02 * scale


def test_tied_head_gradient_adds_to_the_embedding_gradient():
    # The head's weight is the input embedding: the same Parameter is used twice.
    gen = torch.Generator().manual_seed(5)
    embedding = torch.randn(V, H, generator=gen, dtype=F64)
    mixer = torch.randn(H, H, generator=gen, dtype=F64)
    ids = torch.randint(0, V, (N,), generator=gen)
    labels = torch.roll(ids, -1)
    grads = []
    for fused in (True, False):
        table = embedding.clone().requires_grad_(True)
        hidden = torch.tanh(F.embedding(ids, table) @ mixer)  # (N, H), a function of the table too
        if fused:
            log_probs, entropy = log_probs_from_hidden(hidden, table, labels, temperature=0.8, return_entropy=True,
                                                       chunk_tokens=5)
        else:
            log_probs, entropy = plain(hidden, table, None, labels, 0.8)
        (log_probs.sum() + 0.5 * entropy.sum()).backward()
        grads.append(table.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=0)
    # Both uses contribute: the embedding's rows of tokens never read (as inputs) still get the head's gradient.
    unread = torch.ones(V, dtype=torch.bool)
    unread[ids] = False
    assert unread.any() and grads[0][unread].abs().sum() > 0


def test_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    hidden, weight, bias, labels, upstream = inputs(seed=6)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    log_probs, _ = log_probs_from_hidden(hidden, weight, labels, bias, chunk_tokens=4)
    (log_probs * upstream[0]).sum().backward()
    assert weight.grad is None and bias.grad is None
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    (plain(ref_hidden, weight, bias, labels)[0] * upstream[0]).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-10, rtol=0)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_holds_the_logits_of_more_than_one_chunk():
    rows, vocab, chunk = 64, 50, 8
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(rows, 3, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 3, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    with LargestTensor() as probe:
        log_probs, entropy = log_probs_from_hidden(hidden, weight, labels, softcap=3.0, return_entropy=True,
                                                   chunk_tokens=chunk)
        (log_probs.sum() + entropy.sum()).backward()
    assert probe.largest == chunk * vocab  # one chunk's logits; the whole would be 64 x 50
    with LargestTensor() as probe:
        plain(hidden, weight, None, labels)
    assert probe.largest == rows * vocab  # the probe sees the plain route's whole logits


def test_no_rows():
    hidden, weight, bias, labels, _ = inputs(seed=8, rows=0)
    log_probs, entropy = log_probs_from_hidden(hidden, weight, labels, bias, return_entropy=True)
    assert log_probs.shape == entropy.shape == (0,)
    (log_probs.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, H) and (weight.grad == 0).all() and (bias.grad == 0).all()


@pytest.mark.parametrize("change, match", [
    (dict(hidden=torch.zeros(2, 3, H)), "hidden must have shape"),
    (dict(weight=torch.zeros(V, H + 1)), "weight must be"),
    (dict(labels=torch.zeros(N + 1, dtype=torch.long)), "labels must have shape"),
    (dict(bias=torch.zeros(V + 1)), "bias has shape"),
    (dict(weight=torch.zeros(V, H, dtype=torch.bfloat16)), "weight is torch.bfloat16"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(softcap=-1.0), "softcap must be > 0"),
    (dict(banned_ids=torch.zeros(1, 2, dtype=torch.long)), "banned_ids must be a 1-D"),
    (dict(chunk_tokens=0), "chunk_tokens must be an int >= 1"),
    (dict(chunk_tokens=2.5), "chunk_tokens must be an int >= 1"),
])
def test_bad_arguments_are_named(change, match):
    arguments = dict(hidden=torch.zeros(N, H), weight=torch.zeros(V, H), labels=torch.zeros(N, dtype=torch.long),
                     bias=None)
    options = {}
    for key, value in change.items():
        (arguments if key in arguments else options)[key] = value
    with pytest.raises(ValueError, match=match):
        log_probs_from_hidden(**arguments, **options)
