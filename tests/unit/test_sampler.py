import pytest
import torch

from shardlm.layers.sampler import Sampler, SamplingBatch, apply_penalties

V = 50


def batch_for(n, temperature=1.0, **kw):
    return SamplingBatch(temperature=torch.full((n,), temperature), greedy=torch.zeros(n, dtype=torch.bool), **kw)


def test_greedy_is_argmax():
    logits = torch.randn(4, V)
    tokens, _ = Sampler()(logits, SamplingBatch(None, None))
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, V)
    alone, _ = Sampler()(logits, batch_for(1, generators={0: torch.Generator().manual_seed(42)}))
    crowd = torch.cat([torch.randn(3, V), logits])
    others, _ = Sampler()(crowd, batch_for(4, generators={3: torch.Generator().manual_seed(42)}))
    assert others[3] == alone[0]


def test_random_rows_draw_from_the_softmax():
    """Inverse transform sampling: 40,000 rows of one distribution (tokens from 0.45 down to 1e-4,
    and two of probability 0) give counts that fit it (chi-square, p > 0.001; a token at 1e-4 is
    seen), never a token of probability 0."""
    from tests.models.test_spec_decode import chi2_contingency_p
    torch.manual_seed(3)
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.0499, 0.0, 1e-4, 0.0])
    logits = probs.log().repeat(40000, 1)            # log 0 = -inf: probability 0
    tokens, _ = Sampler()(logits, batch_for(40000))
    counts = torch.bincount(torch.tensor(tokens), minlength=8)
    assert counts[5] == counts[7] == 0 and counts[6] > 0
    expected = (probs * 40000).round().long()
    keep = [i for i in range(8) if probs[i] > 0]
    assert chi2_contingency_p([[int(counts[i]) for i in keep], [int(expected[i]) for i in keep]]) > 0.001


def test_a_uniform_draw_at_either_end_takes_a_token_of_the_row(monkeypatch):
    """u = 0 gives the first token of probability > 0; u just below 1 the last, also where min-p
    leaves a total of 0.5, a power of two (u x total is then exact, just below it): never a token
    of probability 0."""
    import math
    logits = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]] * 2 + [[math.log(2), 0.0, 0.0, float("-inf")]])
    edges = torch.tensor([[0.0], [1.0 - 2.0 ** -53], [1.0 - 2.0 ** -53]], dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: edges.clone())
    tokens, _ = Sampler()(logits, batch_for(3, min_p=torch.tensor([0.0, 0.0, 0.6])))
    assert tokens == [1, 2, 0]


def test_a_row_of_infinite_logits_takes_its_largest(monkeypatch):
    """A repetition penalty of 5e-324 (valid: above 0) divides logits into infinities, whose
    softmax is not a number: that row takes its largest logit (the first +inf), the others sample
    as ever (a schema fuzz case that failed its request with an IndexError)."""
    logits = torch.tensor([[-1.0, 2.0, float("inf"), float("inf")], [0.0, 0.0, 0.0, 0.0]])
    tokens, _ = Sampler()(logits, batch_for(2))
    assert tokens[0] == 2 and 0 <= tokens[1] < 4


def test_top_k_only_samples_the_top_k():
    torch.manual_seed(0)
    logits = torch.randn(1, V).repeat(200, 1)
    tokens, _ = Sampler()(logits, batch_for(200, temperature=5.0, top_k=torch.full((200,), 3)))
    assert set(tokens) <= set(logits[0].topk(3).indices.tolist()) and len(set(tokens)) > 1


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)])).repeat(300, 1)
    tokens, _ = Sampler()(logits, batch_for(300, top_p=torch.full((300,), 0.7)))
    assert set(tokens) == {0, 1}     # 0.5 < 0.7 needs token 1 too; 0.8 >= 0.7 stops there


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.35, 0.05] + [1e-9] * (V - 3)])).repeat(300, 1)
    tokens, _ = Sampler()(logits, batch_for(300, min_p=torch.full((300,), 0.1)))
    assert set(tokens) == {0, 1}


def test_greedy_and_random_rows_mix():
    logits = torch.randn(2, V)
    b = batch_for(2)
    b.greedy = torch.tensor([True, False])
    tokens, _ = Sampler()(logits, b)
    assert tokens[0] == int(logits[0].argmax())


def test_penalties():
    logits = torch.zeros(1, V)
    logits[0, 1] = 2.0
    logits[0, 2] = -2.0
    out = apply_penalties(logits.clone(), torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]),
                          [[2]], [[1, 1]])
    assert out[0, 1] == 2.0 / 2.0 - 0.25 * 2 - 0.5   # repetition, then frequency x2 and presence
    assert out[0, 2] == -2.0 * 2.0                    # prompt token: repetition only
    assert out[0, 3] == 0.0


def test_banned_tokens_and_logprobs():
    logits = torch.tensor([[5.0, 1.0, 0.0] + [-10.0] * (V - 3)])
    b = SamplingBatch(None, None, banned=[(0, [0])], logprobs_k=[2])
    tokens, lps = Sampler()(logits, b)
    assert tokens == [1]
    lp = lps[0]
    raw = torch.log_softmax(logits[0], -1)
    assert lp.token_id == 1 and lp.rank == 2 and abs(lp.logprob - float(raw[1])) < 1e-6
    assert lp.top_ids == [0, 1]      # logprobs are of the raw model output


def test_logit_bias_and_allowed_token_ids_match_a_hand_computation():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    before = logits.clone()
    biases = [(0, {3: 5.0, int(logits[0].argmax()): -100.0}, None),     # OpenAI: added before sampling
              (1, {5: 1.0}, [2, 5, 9])]                                  # vLLM: only these may be sampled
    tokens, lps = Sampler()(logits, SamplingBatch(None, None, biases=biases, logprobs_k=[1, None, None]))
    by_hand = logits.clone()
    by_hand[0, 3] += 5.0
    by_hand[0, int(logits[0].argmax())] -= 100.0
    row1 = torch.full((V,), float("-inf"))
    row1[[2, 5, 9]] = logits[1, [2, 5, 9]]
    row1[5] += 1.0
    assert tokens == [int(by_hand[0].argmax()), int(row1.argmax()), int(logits[2].argmax())]
    assert tokens[0] != int(logits[0].argmax())              # the bias changed the choice
    # logprobs stay those of the model's own distribution (as vLLM reports them)
    assert abs(lps[0].logprob - float(torch.log_softmax(logits[0], -1)[tokens[0]])) < 1e-5
    assert logits.equal(before)                              # the caller's logits are untouched


def test_allowed_token_ids_bound_random_sampling():
    torch.manual_seed(0)
    logits = torch.randn(1, V).repeat(300, 1)
    allowed = [4, 17, 33]
    tokens, _ = Sampler()(logits, batch_for(300, temperature=3.0, biases=[(r, None, allowed) for r in range(300)]))
    assert set(tokens) == set(allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax(dtype):
    """The C argmax (rows in parallel) picks what torch.argmax picks: the first of equal maxima,
    the first NaN, index 0 of a row of -inf; vocabularies that are not a multiple of 16; a view."""
    from shardlm.kernels import fused_ops
    from shardlm.layers.sampler import ArgmaxRows
    argmax_rows = ArgmaxRows()
    assert fused_ops() is not None, "the C kernel is what is under test"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 49157, generator=gen).to(dtype)
    x[1, 100] = x[1, 20000] = x[1, 49156] = 50.0          # ties: the first wins
    x[2, :] = float("-inf")
    x[3, 300] = x[3, 7] = float("nan")                      # the first NaN wins
    x[4, 49150:] = 60.0                                     # maxima in the tail past the last 16
    x[5, 0] = 70.0
    x[6, 3] = float("inf")
    x[7, :] = 1.0                                           # all equal
    for rows in (x, x[:1], x[:, :49141], x[:, 5:]):        # one row; views with a row stride of their own
        assert torch.equal(argmax_rows(rows), rows.float().argmax(dim=-1))


def test_each_logprobs_mode_reports_what_it_names():
    """raw_*: the model's output; processed_*: what the token was drawn from (temperature 0.5,
    top-k 3 here: the other tokens are -inf). Each entry's rank follows its value."""
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    batch = batch_for(2, temperature=0.5, top_k=torch.full((2,), 3), logprobs_k=[4, None],
                      generators={0: torch.Generator().manual_seed(1)})
    expected = {"raw_logprobs": torch.log_softmax(logits, -1), "raw_logits": logits}
    kept = logits / 0.5
    kept = kept.masked_fill(kept < kept.topk(3, dim=-1).values[:, -1:], float("-inf"))
    expected.update(processed_logits=kept, processed_logprobs=torch.log_softmax(kept, -1))
    for mode, values in expected.items():
        tokens, lps = Sampler(mode)(logits, batch)
        assert list(lps) == [0], "only the row that asked"
        lp = lps[0]
        assert lp.token_id == tokens[0] and lp.logprob == pytest.approx(values[0, tokens[0]].item(), abs=1e-5), mode
        assert lp.top_ids == values[0].topk(4).indices.tolist(), mode
        assert lp.top_logprobs == pytest.approx(values[0].topk(4).values.tolist(), abs=1e-5), mode
        assert lp.rank == int((values[0] > values[0, tokens[0]]).sum()) + 1
    assert Sampler("processed_logprobs")(logits, batch)[1][0].top_logprobs[3] == float("-inf")


def test_completing_bad_words():
    from shardlm.layers.sampler import completing_bad_words
    words = [[7], [1, 2, 3], [2, 9]]
    assert completing_bad_words([], words) == [7]
    assert completing_bad_words([5, 1, 2], words) == [7, 3, 9]
    assert completing_bad_words([1, 2, 4], words) == [7]
    assert completing_bad_words([2], words) == [7, 9]
