"""Radix-select top-k (dsv4_kernels/triton_topk.py: one program a row; triton_topk_split.py: a row over several
programs), the bitonic sort top-k (triton_topk_sort.py: a row in one program's registers) and the rank-counting
top-k (triton_topk_rank.py: every score compared with its row) against torch.topk.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter. The kernel's picks are a set:
compared with torch.topk's as sorted values (equal multisets), distinct columns, the same number of -1, and
ties at the k-th value resolved to the lowest columns.
"""

import pytest
import torch

from dsv4_kernels.triton_topk import MAX_BLOCK  # noqa: E402
from dsv4_kernels.triton_topk import topk_columns as one_program  # noqa: E402
from dsv4_kernels.triton_topk_rank import topk_columns_ranked  # noqa: E402
from dsv4_kernels.triton_topk_sort import SORT_MAX_CANDIDATES, topk_columns_sorted  # noqa: E402
from dsv4_kernels.triton_topk_split import topk_columns_split  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

NEG_INF = float("-inf")
IMPLS = {
    "one program": one_program,
    "split": topk_columns_split,  # programs_per_row: chunks of MIN_CHUNK columns
    "split, 3 programs": lambda x, k: topk_columns_split(x, k, programs=3),  # chunks of several blocks
    "split, 64 programs": lambda x, k: topk_columns_split(x, k, programs=64),  # short chunks, some rows empty
    "sort": topk_columns_sorted,
    "rank": topk_columns_ranked,
}


@pytest.fixture(params=list(IMPLS))
def topk_columns(request):
    return IMPLS[request.param]


def reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk with the engine's padding and -1 convention (dsv4_kernels.triton_indexer.topk_of_scores)."""
    padded = torch.nn.functional.pad(scores, (0, max(0, k - scores.shape[1])), value=NEG_INF)
    top = padded.topk(k, dim=-1)
    return torch.where(top.values > NEG_INF, top.indices, -1)


def check_rows(scores: torch.Tensor, got: torch.Tensor, k: int) -> None:
    want = reference(scores, k)
    assert got.shape == want.shape and got.dtype == torch.int64
    for i in range(scores.shape[0]):
        g, w = got[i], want[i]
        assert int((g == -1).sum()) == int((w == -1).sum()), i
        picks = g[g >= 0]
        assert picks.unique().numel() == picks.numel(), f"row {i}: a column picked twice"
        assert torch.equal(scores[i, picks].sort().values, scores[i, w[w >= 0]].sort().values), i
        if picks.numel():  # ties at the k-th value: the lowest columns of that value
            kth = scores[i, picks].min()
            tied_cols = (scores[i] == kth).nonzero().flatten()
            taken = picks[scores[i, picks] == kth].sort().values
            assert torch.equal(taken, tied_cols[: taken.numel()]), f"row {i}: ties not the lowest columns"


def random_scores(t: int, s: int, seed: int, holes: float = 0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-6, 7, (t, 1), generator=gen).float())  # several binades, both signs
    x = torch.randn(t, s, generator=gen) * scale
    x[torch.rand(t, s, generator=gen) < holes] = NEG_INF
    return x


SHAPES = [
    (3, 70, 16),  # one block, k < S
    (4, 600, 512),  # the indexer's k, a short context
    (2, 5000, 512),  # two blocks (MAX_BLOCK 4096)
    (2, 2 * MAX_BLOCK + 37, 64),  # three blocks, a ragged tail
    (3, 10, 16),  # S < k: -1 past the row
    (2, 50, 1),  # k = 1 (a tiny config's index_topk; the sort kernel keeps 2)
]
# Split over 64 programs (each program one short block; the interpreter runs rows x programs x 5 passes one after
# another): the two-block row (79-column chunks in 128-wide blocks, a ragged last one: the many-program histogram
# and write paths) and S < k (one-column chunks, program 0's -1 padding, an all -inf row) run; with the ties test
# (each of ~60 programs counting the ties in the chunks before its own) they cover its paths. Left out, as repeats
# of those at 30-75 s each on the 2-core CI box: the three-block row (the two-block row's path again), the 70- and
# 600-column rows (2- and 10-column chunks: the tiny-chunk and tie paths again; -inf ties run on the other impls).
SLOW_REPEATS = {("split, 64 programs", SHAPES[i]) for i in (0, 1, 3)}
SLOW_REPEATS.add(("sort", SHAPES[3]))  # longer than a sorted row may be (test_sort_refuses_long_rows)
SLOW_REPEATS.add(("rank", SHAPES[3]))  # 37 s in the interpreter (S^2 work); the two-block row has a ragged tail too
# The two-block row (a radix notion: MAX_BLOCK) on the sort and rank kernels: 32-36 s each in the interpreter on CI.
# The sort kernel's large rows run in test_sort_takes_a_full_block_row (8192 columns), the rank kernel's many column
# tiles and k = 512 in the 600-column row and in test_rank_by_segments_matches_torch.
SLOW_REPEATS |= {("sort", SHAPES[2]), ("rank", SHAPES[2])}
CASES = [(impl, *shape) for impl in IMPLS for shape in SHAPES if (impl, shape) not in SLOW_REPEATS]


@pytest.mark.parametrize("impl,t,s,k", CASES)
def test_topk_matches_torch(impl, t, s, k):
    scores = random_scores(t, s, seed=t * 1000 + s)
    scores[0] = NEG_INF if s < k else scores[0]  # a row with nothing valid when short
    check_rows(scores, IMPLS[impl](scores.to(DEVICE), k).cpu(), k)


def tie_scores() -> torch.Tensor:
    """fp32 [4, 900]: 0 nine values (every k-th value tied), 1 the same with -inf holes, 2 one value everywhere with
    -0.0 in it (a different key, the same float), 3 near fp32's largest, the smallest normal and a subnormal."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.randint(-4, 5, (4, 900), generator=gen).float()
    scores[1, ::3] = NEG_INF
    scores[2] = 0.0
    scores[2, 5::7] = -0.0
    scores[3, :100] = 3.0e38
    scores[3, 100:200] = 1.2e-38
    scores[3, 200:300] = 1e-45
    return scores


# The 64-program split (the interpreter runs rows x ~60 programs x 5 passes: 70-100 s for all four rows on the 2-core
# CI box) takes rows 0 and 2, whose ties at the k-th value send each program through the count of the ties in the
# chunks before its own; rows 1 and 3 test the keys' order (order_keys, shared by both kernels), run by the other
# three impls, the split kernel at 3 and 4 programs among them.
TIE_ROWS = {"split, 64 programs": [0, 2]}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_ties_at_the_boundary_take_the_lowest_columns(impl):
    rows = TIE_ROWS.get(impl, [0, 1, 2, 3])
    scores = tie_scores()[rows]
    got = IMPLS[impl](scores.to(DEVICE), 128).cpu()
    for i, row in enumerate(rows):
        if row != 2:
            check_rows(scores[i : i + 1], got[i : i + 1], 128)
            continue
        # -0.0 == 0.0 as floats but orders below it as a key: the 128 picks are +0.0 columns, the lowest ones
        plus_zero = (scores[i] == 0) & ~torch.signbit(scores[i])
        assert torch.equal(got[i].sort().values, plus_zero.nonzero().flatten()[:128])


def test_bad_arguments_are_value_errors(topk_columns):
    with pytest.raises(ValueError, match="fp32"):
        topk_columns(torch.zeros(2, 8, dtype=torch.float16, device=DEVICE), 4)
    with pytest.raises(ValueError, match="k >= 1"):
        topk_columns(torch.zeros(2, 8, device=DEVICE), 0)
    assert topk_columns(torch.zeros(0, 8, device=DEVICE), 4).shape == (0, 4)


def test_sort_refuses_long_rows():
    with pytest.raises(ValueError, match=f"at most {SORT_MAX_CANDIDATES} candidates"):
        topk_columns_sorted(torch.zeros(1, SORT_MAX_CANDIDATES + 1, device=DEVICE), 512)


def test_sort_takes_a_full_block_row():
    """A row of exactly SORT_MAX_CANDIDATES (the largest block: 8192 64-bit keys in one program) with -inf holes."""
    scores = random_scores(1, SORT_MAX_CANDIDATES, seed=11)
    check_rows(scores, topk_columns_sorted(scores.to(DEVICE), 512).cpu(), 512)


# The rank-counting kernel in two launches (each segment's k best, then those ranked): pieces shorter than k, k = 1,
# a ragged last piece, the indexer's k over three pieces, and every k-th value tied across pieces.
SEGMENT_CASES = [(3, 70, 16, 32), (3, 10, 16, 32), (2, 50, 1, 16), (2, 2000, 64, 512), (1, 5000, 512, 2048)]


@pytest.mark.parametrize("t,s,k,segment", SEGMENT_CASES)
def test_rank_by_segments_matches_torch(t, s, k, segment):
    scores = random_scores(t, s, seed=t * 1000 + s + segment)
    scores[0] = NEG_INF if s < k else scores[0]
    check_rows(scores, topk_columns_ranked(scores.to(DEVICE), k, segment=segment).cpu(), k)


def test_rank_by_segments_keeps_ties_in_column_order():
    scores = tie_scores()
    got = topk_columns_ranked(scores.to(DEVICE), 128, segment=256).cpu()  # 4 pieces: ties across them
    for i in (0, 1, 3):
        check_rows(scores[i : i + 1], got[i : i + 1], 128)
    plus_zero = (scores[2] == 0) & ~torch.signbit(scores[2])
    assert torch.equal(got[2].sort().values, plus_zero.nonzero().flatten()[:128])


def test_rank_segment_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of"):
        topk_columns_ranked(torch.zeros(1, 100, device=DEVICE), 8, segment=24)


def test_rank_rule_by_work_and_segment(monkeypatch):
    """dsv4_kernels.triton_indexer.rank_topk_segment: one launch under the work bound, two only with a segment set
    (rounded up to whole blocks) when the pieces' survivors are fewer than the row and the work fits; by default
    batch 1 at 8192 candidates (a 32K context) takes two launches of 2048-candidate pieces."""
    from dsv4_kernels import settings
    from dsv4_kernels.triton_indexer import rank_topk_segment

    monkeypatch.delenv(settings.TOPK_RANK_MAX_WORK, raising=False)
    monkeypatch.delenv(settings.TOPK_RANK_SEGMENT, raising=False)
    settings.reload()
    assert rank_topk_segment(1, 8192, 512) == 2048 and rank_topk_segment(2, 8192, 512) is None
    monkeypatch.setenv(settings.TOPK_RANK_MAX_WORK, str(1 << 25))
    monkeypatch.setenv(settings.TOPK_RANK_SEGMENT, "0")
    settings.reload()
    try:
        assert rank_topk_segment(1, 2048, 512) == 0 and rank_topk_segment(8, 2048, 512) == 0
        assert rank_topk_segment(16, 2048, 512) is None  # 67M comparisons
        assert rank_topk_segment(1, 8192, 512) is None  # no segment set
        assert rank_topk_segment(300, 10, 512) is None  # more rows than the kernels take
        monkeypatch.setenv(settings.TOPK_RANK_SEGMENT, "2040")
        settings.reload()
        assert rank_topk_segment(1, 8192, 512) == 2048  # 16.8M + 4.2M
        assert rank_topk_segment(1, 16384, 512) is None  # 33.6M + 16.8M
        assert rank_topk_segment(1, 8192, 4096) is None  # survivors (8 x 4096) not fewer than the row
    finally:
        monkeypatch.undo()
        settings.reload()
