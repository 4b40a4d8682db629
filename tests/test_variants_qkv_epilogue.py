"""qkv_epilogue planner (pure: no cutlass, no GPU): validation, launch geometry, the build rule, the plan."""
from __future__ import annotations

import pytest

from musekern.config import load_config
from musekern.kernels.qkv_epilogue.variant import (
    EPI_BLOCK,
    EPI_CTAS_PER_SM,
    EPI_HUGE,
    EPI_LANES,
    EPI_LARGE,
    EPI_MAX_UNITS,
    EPI_ROUNDS_CHOICES,
    EPI_ROUNDS_VECTORS,
    EPI_SMALL,
    EPI_SMALL_VECTORS,
    EPI_VPT_CHOICES,
    QkvEpilogueVariant,
    all_builds,
    epilogue_bytes,
    epilogue_variant,
    epilogue_vectors,
    head_counts,
    launch_grid,
    max_rows,
    qkv_epilogue_variants,
    row_units,
    rows_served,
)
from musekern.plan import plan_model, variant_from_label
from musekern.targets import get_target

# the bundled model's shards (TP 8, 4, 2, 1): (N, nkv) -> nq
SHARDS = {(2176, 1): 16, (4352, 2): 32, (8704, 4): 64, (17408, 8): 128}


BUILDS = [QkvEpilogueVariant(vpt, r) for vpt in EPI_VPT_CHOICES for r in EPI_ROUNDS_CHOICES]


def test_all_builds_is_every_vecs_per_thread_with_every_rounds():
    """The one list the GPU tests, the sanitizer, epilogue_cache.sh and the sweep take."""
    assert list(all_builds()) == BUILDS


# one round is the default: its label (and so its key) is the one from before rounds existed
@pytest.mark.parametrize("v", BUILDS, ids=lambda v: v.label)
def test_variant_label_round_trips(v):
    extra = "" if v.rounds == 1 else f"rounds={v.rounds},"
    assert v.label == f"qkv_epilogue[{extra}vecs_per_thread={v.vecs_per_thread}]"
    assert variant_from_label(v.label) == v
    assert v.ctas_per_sm == EPI_CTAS_PER_SM[(v.vecs_per_thread, v.rounds)]


@pytest.mark.parametrize("bad", [0, 3, 16, -1, "4"])
def test_bad_vecs_per_thread(bad):
    with pytest.raises(ValueError, match="vecs_per_thread"):
        QkvEpilogueVariant(bad)


@pytest.mark.parametrize("bad", [0, 3, 4, -1, "2"])
def test_bad_rounds(bad):
    with pytest.raises(ValueError, match="rounds"):
        QkvEpilogueVariant(2, bad)


def test_frozen():
    with pytest.raises(AttributeError):
        QkvEpilogueVariant(4).vecs_per_thread = 1


@pytest.mark.parametrize("n,nkv", list(SHARDS))
def test_head_counts_of_the_shards(n, nkv):
    assert head_counts(n, nkv) == (SHARDS[(n, nkv)], nkv)
    assert epilogue_vectors(3, n, nkv) == 3 * (SHARDS[(n, nkv)] + 2 * nkv) * EPI_LANES


@pytest.mark.parametrize("n,nkv", [(2176, 2), (2177, 1), (128, 1), (0, 1), (2176, 0)])
def test_head_counts_rejects_other_layouts(n, nkv):
    with pytest.raises(ValueError, match="q\\|k\\|v\\|gate"):
        head_counts(n, nkv)


# Grid = ceil(M * 8 * ceil(H / vpt) / (256 * rounds)), H = nq + 2 nkv: TP8 H = 18 (a partial last head group at vpt
# 4 and 8), TP1 H = 144 (none), the smallest layout H = 3 (N = 256: vpt 4 and 8 have one partial group), M = 0 and
# 1, and two rounds (half the CTAs, rounded up).
@pytest.mark.parametrize("n,nkv,m,vpt,rounds,want", [
    (2176, 1, 0, 4, 1, 0),
    (2176, 1, 1, 1, 1, 1),  # 144 units
    (2176, 1, 1, 4, 1, 1),  # 40 units
    (2176, 1, 16, 1, 1, 9),  # 2304 units
    (2176, 1, 16, 2, 1, 5),  # 1152
    (2176, 1, 16, 2, 2, 3),  # 1152 units, 512 a CTA
    (2176, 1, 16, 4, 1, 3),  # 640
    (2176, 1, 16, 8, 1, 2),  # 384
    (2176, 1, 65536, 4, 1, 10240),
    (2176, 1, 65536, 2, 2, 9216),  # 4718592 units
    (17408, 8, 64, 1, 1, 288),
    (17408, 8, 64, 8, 1, 36),
    (17408, 8, 65536, 4, 1, 73728),
    (256, 1, 1, 4, 1, 1),
    (256, 1, 1000, 8, 1, 32),  # 8000 units
    (256, 1, 1000, 8, 2, 16),
])
def test_launch_grid(n, nkv, m, vpt, rounds, want):
    v = QkvEpilogueVariant(vpt, rounds)
    assert launch_grid(v, m, n, nkv) == (want, 1, 1)
    h = sum(head_counts(n, nkv)) + nkv
    assert row_units(v, n, nkv) == EPI_LANES * -(-h // vpt)


def test_launch_grid_limits():
    for v in BUILDS:
        for n, nkv in SHARDS:
            top = max_rows(v, n, nkv)
            assert top >= 65536  # the M range, with every build
            gx = launch_grid(v, top, n, nkv)[0]
            assert gx * EPI_BLOCK * v.rounds - 1 <= 2**31 - 1  # the last round's Int32 unit index never overflows
            with pytest.raises(ValueError, match="Int32"):
                launch_grid(v, top + 1, n, nkv)
    with pytest.raises(ValueError, match=">= 0"):
        launch_grid(QkvEpilogueVariant(1), -1, 2176, 1)
    assert EPI_MAX_UNITS + EPI_BLOCK * max(EPI_ROUNDS_CHOICES) - 1 <= 2**31 - 1


def _tier(vectors):
    return EPI_SMALL if vectors <= EPI_SMALL_VECTORS else EPI_LARGE if vectors <= EPI_ROUNDS_VECTORS else EPI_HUGE


# The rule: up to EPI_SMALL_VECTORS vectors the small build, up to EPI_ROUNDS_VECTORS the large one, above it two
# rounds; both edges per shard (small: M = 227 / 228 at TP8, 28 / 29 at TP1; rounds: M = 14563 / 14564 at TP8, 1820
# / 1821 at TP1) and the M grid of the GPU tests.
@pytest.mark.parametrize("n,nkv", list(SHARDS))
def test_rule_and_its_edges(n, nkv):
    per_row = epilogue_vectors(1, n, nkv)
    for bound, below, above in ((EPI_SMALL_VECTORS, EPI_SMALL, EPI_LARGE), (EPI_ROUNDS_VECTORS, EPI_LARGE, EPI_HUGE)):
        edge = bound // per_row
        assert epilogue_variant(n, edge, nkv) == QkvEpilogueVariant(*below)
        assert epilogue_variant(n, edge + 1, nkv) == QkvEpilogueVariant(*above)
    for m in (1, 8, 16, 17, 24, 31, 32, 33, 48, 64, 65, 100, 128, 255, 256, 1000, 4096, 16384, 65536):
        v = epilogue_variant(n, m, nkv)
        assert v in qkv_epilogue_variants()
        lo, hi = rows_served(v, n, nkv)
        assert lo <= m <= hi
        assert (v.vecs_per_thread, v.rounds) == _tier(epilogue_vectors(m, n, nkv))


def test_rows_served_partition_every_m():
    for n, nkv in SHARDS:
        spans = sorted(rows_served(v, n, nkv) for v in qkv_epilogue_variants())
        assert spans[0][0] == 1 and len(spans) == 3
        for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False):
            assert lo == hi + 1
        others = [v for v in BUILDS if v not in qkv_epilogue_variants()]
        assert all(rows_served(v, n, nkv) is None for v in others)


def test_plan_has_the_epilogue_for_every_shard():
    for target in ("h200", "h100", "b200"):
        entries = [e for e in plan_model(load_config(), [get_target(target)]) if e.kernel == "qkv_epilogue"]
        assert sorted(e.variant.label for e in entries) == sorted(v.label for v in qkv_epilogue_variants())
        for e in entries:
            assert e.tps == (1, 2, 4, 8)  # one build serves every shard


def test_bytes_formula_by_hand():
    # TP8, M = 1: q + k heads read and written (17 x 128 B x 2), v read (128), k and v to the caches (2 x 128),
    # position + slot (16) and a cos|sin row (256)
    assert epilogue_bytes(1, 2176, 1) == 17 * 256 + 128 + 256 + 16 + 256
    # padding tokens write no cache rows
    assert epilogue_bytes(4, 2176, 1, written_slots=1) == 4 * (17 * 256 + 128 + 16 + 256) + 256
    assert epilogue_bytes(0, 17408, 8) == 0
