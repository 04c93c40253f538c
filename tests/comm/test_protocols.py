"""gradq.comm protocols on 2 and 4 gloo processes (one spawn per world size runs every check).

Each child runs every (protocol, spec, n) case and saves its outputs; the parent asserts that every
rank got identical bytes and recomputes the expected result in one process from the same derived seeds
(the children's gradients are a pure function of (rank, n)).
"""

from __future__ import annotations

import pytest
import gradq_testing
import torch

import gradq
from gradq.comm.api import average, choose_protocol
from gradq.comm import (allgather_mean, code_dtype, derive_seed, parameter_server_mean, reduce_dtype,
                        scatter_allgather, shared_scale_allreduce)

SEED = 1234
ANY = ["none", "qsgd:bits=4,bucket=64", "qsgd:bits=4,bucket=64,coding=elias", "topk:ratio=0.1",
       "terngrad", "randk:ratio=0.25"]
SUMMABLE = ["none", "bf16", "maxnorm:bits=4", "maxnorm:bits=8", "multiscale", "terngrad",
            "randk-maxnorm:ratio=0.25"]
SIZES = (1001, 3)
EF_SPECS = ["maxnorm:bits=2", "randk:ratio=0.25"]   # (the scatter protocol with both error feedback memories)
SEGMENTED = ["qsgd:bits=4,bucket=64", "qsgd:bits=4,bucket=64,coding=elias", "terngrad", "topk:ratio=0.1"]  # 1001: not divisible by 2 or 4; 3: fewer coordinates than 4 workers


def grad(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * rank + n)
    return torch.randn(n, generator=g) * (1.0 + rank)


def cases():
    out = []
    for n in SIZES:
        for spec in ANY:
            out += [("allgather", spec, n, {}), ("scatter", spec, n, {}), ("ps", spec, n, {}),
                    ("ps", spec, n, {"requantize": True})]
        for spec in SUMMABLE:
            out.append(("allreduce", spec, n, {}))
    return out


API_SPECS = {"maxnorm:bits=4": "allreduce", "qsgd:bits=4": "scatter", "topk:ratio=0.2": "scatter",
             "qsgd:bits=4,coding=elias": "allgather"}


def _key(proto, spec, n, kw):
    return f"{proto}|{spec}|{n}|{sorted(kw.items())}"


class _Concatenations(torch.utils._python_dispatch.TorchDispatchMode):
    """The lengths of the concatenations made inside (``torch.cat``)."""

    def __init__(self):
        super().__init__()
        self.lengths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] == "cat":
            self.lengths.append(out.numel())
        return out


def _child(rank: int, world: int, tmp: str) -> None:
    gradq_testing.init_gloo(tmp, rank, world)
    fns = {"allgather": allgather_mean, "scatter": scatter_allgather, "ps": parameter_server_mean,
           "allreduce": shared_scale_allreduce}
    res: dict = {}
    unseeded = gradq_testing.count_unseeded_decodes()
    for proto, spec, n, kw in cases():
        info: dict = {}
        before = unseeded[0]
        res[_key(proto, spec, n, kw)] = fns[proto](grad(rank, n), gradq.build(spec), seed=SEED, info=info, **kw)
        res["info|" + _key(proto, spec, n, kw)] = info
        res["unseeded|" + _key(proto, spec, n, kw)] = unseeded[0] - before
    for spec in EF_SPECS:
        q, ef2 = gradq.ErrorFeedback(spec), gradq.ErrorFeedback(spec)
        for step in range(2):  # memories carry over between calls
            info = {}
            before = unseeded[0]
            res[f"ef|{spec}|{step}"] = scatter_allgather(grad(rank, 1001) * (step + 1), q, seed=SEED + step,
                                                         name="w", second_ef=ef2, info=info)
            res[f"info|ef|{spec}|{step}"] = info
            res[f"ef|{spec}|{step}|unseeded"] = unseeded[0] - before
    from gradq.comm._util import SMALL_SUM_BYTES, all_gather_bytes, sum_over_ranks
    from gradq.comm.allreduce import shared_scale_allreduce_many
    # small vectors: one all-to-all and a rank-order sum; large ones: the backend's all-reduce
    small, big = grad(rank, 1000), grad(rank, SMALL_SUM_BYTES // 4 // world + 1)
    res["sum_small"] = sum_over_ranks(small.clone(), None)
    res["sum_big"] = sum_over_ranks(big.clone(), None)
    from gradq.comm._util import reduce_over_ranks
    res["max_small"] = reduce_over_ranks(small.clone(), None, op="max")[0]
    res["min_big"] = reduce_over_ranks(big.clone(), None, op="min")[0]
    from gradq.comm._util import TWO_ROUND_BYTES, reduce_segments
    mid, huge = grad(rank, TWO_ROUND_BYTES // 4 - 3), grad(rank, TWO_ROUND_BYTES // 4 + 1)
    res["sum_mid"] = sum_over_ranks(mid.clone(), None)      # 4 ranks: two all-to-alls; 2 ranks: the ring
    res["sum_huge"] = sum_over_ranks(huge.clone(), None)    # the backend's all-reduce
    for label, x in (("small", small), ("mid", mid), ("huge", huge)):  # MAX, SUM and MIN in one vector
        n = x.numel()
        res[f"segments|{label}"] = reduce_segments(x.clone(), [(7, "max"), (n - 14, "sum"), (7, "min")], None)
    q = gradq.build("terngrad")
    xs = [grad(rank, 300), grad(rank, 1001)]
    for k in (10, 70_000):  # an extra vector beside the statistics (70 000: an exchange of its own)
        info: dict = {}
        outs = shared_scale_allreduce_many(xs, q, seeds=[1, 2], names=["a", "b"], info=info,
                                           extra=grad(rank, k))
        res[f"extra|{k}"] = (outs, info["extra_sum"], shared_scale_allreduce_many(xs, q, seeds=[1, 2],
                                                                                  names=["a", "b"]))
    # all-gather of byte buffers of different lengths: small through one all-to-all, large by the ring
    for n in (10, SMALL_SUM_BYTES // world + 5):
        mine = torch.full((n + rank,), rank + 1, dtype=torch.uint8)
        res[f"gather_bytes|{n}"] = [b.clone() for b in all_gather_bytes(mine, None, None)]
    for spec in ("terngrad", "maxnorm:bits=2", "multiscale", "fp16"):  # several tensors in one exchange per kind
        q = gradq.build(spec)
        xs = [grad(rank, 300), grad(rank, 1001), grad(rank, 5)]
        res[f"many|{spec}"] = (shared_scale_allreduce_many(xs, q, seeds=[1, 2, 3], names=["a", "b", "c"]),
                               [shared_scale_allreduce(x, q, seed=sd, name=nm, verify=False)
                                for x, sd, nm in zip(xs, [1, 2, 3], ["a", "b", "c"])])
        # decoded into the inputs themselves (the hook's bucket views; a 2-D one too), and one not; the
        # codes' tensors concatenated (a cast's, its fields' lie in one buffer: reduced there)
        ins = [xs[0].clone(), xs[1].clone().reshape(7, 143), xs[2].clone()]
        with _Concatenations() as cats:
            got = shared_scale_allreduce_many(ins, q, seeds=[1, 2, 3], names=["a", "b", "c"],
                                              outs=[ins[0], ins[1], None])
        res[f"outs|{spec}"] = ([g.reshape(-1) for g in got], [t.data_ptr() for t in ins], [g.data_ptr() for g in got],
                               cats.lengths)
    ts = [grad(rank, 300), grad(rank, 77).reshape(7, 11)]
    for spec in API_SPECS:  # the hook-free entry point against the protocol it picks
        copies = [t.clone() for t in ts]
        res[f"api|{spec}"] = (copies, gradq.allreduce_(copies, spec, seed=SEED, names=["a", "b"]))
        q = gradq.build(spec)
        res[f"apiref|{spec}"] = [average(t, q, choose_protocol(q, world), seed=derive_seed(SEED, None, nm), name=nm,
                                         rank=rank)[0].reshape(t.shape) for t, nm in zip(ts, ["a", "b"])]
    for spec in SEGMENTED:  # pipelined segments (the comm thread), 1001 = 3·300 + 101
        res[f"seg|{spec}"] = scatter_allgather(grad(rank, 1001), gradq.build(spec), seed=SEED, segment=300)
    try:
        shared_scale_allreduce(grad(rank, 16), gradq.build("qsgd"), seed=SEED)
        res["refused"] = None
    except TypeError as e:
        res["refused"] = str(e)
    try:  # ranks disagree on the size: every rank must get a clear error, nobody hangs
        allgather_mean(grad(rank, 8 + rank), gradq.build("none"), seed=SEED)
        res["mismatch"] = None
    except ValueError as e:
        res["mismatch"] = str(e)
    # codes no encode writes, without checksums (as on a GPU): rank 1 receives rank 0's payload with a
    # byte of four 2-bit TernGrad codes of 3. allgather_mean refuses it after its last collective on the
    # rank that decoded it; allreduce_ agrees, so every rank refuses it
    from gradq.comm import allgather as allgather_mod
    gather = allgather_mod.all_gather_bytes

    damage = [-5]   # the last byte of rank 0's codes (its 4-byte scale follows); 0: its header's first

    def bad_gather(*a, **k):
        got = gather(*a, **k)
        if rank == 1:
            got[0] = got[0].clone()
            got[0][damage[0]] = 0xFF
        return got
    allgather_mod.all_gather_bytes = bad_gather
    calls = {"invalid|allgather": lambda: allgather_mean(grad(rank, 400), gradq.build("terngrad:pack=2bit"),
                                                         seed=SEED, checksum=False),
             "invalid|api": lambda: gradq.allreduce_([grad(rank, 400)], "terngrad:pack=2bit", protocol="allgather",
                                                     seed=SEED, checksum=False),
             # a damaged header, which no decode reads: the payload does not parse
             "invalid|header": lambda: allgather_mean(grad(rank, 400), gradq.build("qsgd:bits=4"), seed=SEED,
                                                      checksum=False),
             "invalid|header-api": lambda: gradq.allreduce_([grad(rank, 400)], "qsgd:bits=4", protocol="allgather",
                                                            seed=SEED, checksum=False)}
    try:
        for label, call in calls.items():
            damage[0] = 0 if "header" in label else -5
            try:
                call()
                res[label] = None
            except gradq.PayloadError as e:
                res[label] = str(e)
    finally:
        allgather_mod.all_gather_bytes = gather
    # a damaged exchange of MultiScale's statistics: one reduced scale index names no scale (255), on
    # every rank alike. The decode of the summed fields finds it: the protocol alone raises on every
    # rank; with defer_damage (the hook) it is counted in info["invalid"] and nothing raises
    from gradq.comm import allreduce as allreduce_mod
    merged = allreduce_mod._merged_reduce

    def bad_index(items, group, what, **kw):
        got, sent = merged(items, group, what, **kw)
        for key in got:
            if isinstance(key, tuple) and key[1] == "scale_index":
                got[key] = got[key].clone()
                got[key][3] = 255
        return got, sent
    allreduce_mod._merged_reduce = bad_index
    try:
        for label, defer, spec in (("ms_index|alone", False, "multiscale"), ("ms_index|deferred", True, "multiscale"),
                                   ("ms_index|ef", True, "ef(multiscale)")):
            info = {}
            try:   # (error feedback's decode of its own fields leaves the check to the sum's)
                out = shared_scale_allreduce(grad(rank, 400), gradq.build(spec), seed=SEED, info=info,
                                             defer_damage=defer, check_finite=False)
                res[label] = {"invalid": int(info.get("invalid", 0)), "finite": bool(torch.isfinite(out).all())}
            except gradq.PayloadError as e:
                res[label] = str(e)
    finally:
        allreduce_mod._merged_reduce = merged
    torch.save(res, f"{tmp}/out{rank}.pt")
    gradq_testing.teardown()


def _mean(parts):
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    return acc / len(parts)


def _shared(q, key):
    return derive_seed(SEED, None, key) if q.needs_shared_seed else None


def expect_allgather(spec, n, world):
    q = gradq.build(spec)
    return _mean([q.roundtrip(grad(r, n), seed=derive_seed(SEED, r, "encode"),
                              shared_seed=_shared(q, "shared")) for r in range(world)])


def expect_ps(spec, n, world, requantize):
    avg = expect_allgather(spec, n, world)
    if not requantize:
        return avg
    return gradq.build(spec).roundtrip(avg, seed=derive_seed(SEED, 0, "server"))


def expect_scatter(spec, n, world, xs=None, seed=SEED):
    q = gradq.build(spec)
    c = -(-n // world)
    xs = [grad(r, n) for r in range(world)] if xs is None else xs
    xs = [torch.cat([x, torch.zeros(c * world - n)]).view(world, c) for x in xs]
    chunks = []
    for j in range(world):
        ss = derive_seed(seed, None, f"chunk{j}") if q.needs_shared_seed else None
        avg = _mean([q.roundtrip(xs[r][j], seed=derive_seed(seed, r, f"chunk{j}"), shared_seed=ss)
                     for r in range(world)])
        chunks.append(q.roundtrip(avg, seed=derive_seed(seed, j, "reencode")))
    return torch.cat(chunks)[:n]


def test_segments_are_independent_scatters(run):
    """With segment=300, each 300-coordinate segment (and the 101 left) is a scatter call of its own
    with seed derive_seed(SEED, None, "segment{s}"); the pipeline must not change a single value."""
    world, outs = run
    for spec in SEGMENTED:
        parts = []
        for s, (a, b) in enumerate([(0, 300), (300, 600), (600, 900), (900, 1001)]):
            xs = [grad(r, 1001)[a:b] for r in range(world)]
            parts.append(expect_scatter(spec, b - a, world, xs, derive_seed(SEED, None, f"segment{s}")))
        for r in range(world):
            torch.testing.assert_close(outs[r][f"seg|{spec}"], torch.cat(parts), rtol=1e-6, atol=1e-6)


def expect_allreduce(spec, n, world):
    """(simulated protocol output, mean of the per-rank decodes under the reduced stats)."""
    q = gradq.build(spec)
    ss = _shared(q, "shared")
    xs = [grad(r, n) for r in range(world)]
    stats = [q.shared_stats(x, shared_seed=ss) for x in xs]
    reduced = {}
    for k, (v, op) in stats[0].items():
        stack = torch.stack([s[k].value for s in stats])
        reduced[k] = stack.amax(0) if op == "max" else stack.amin(0) if op == "min" else stack.sum(0)
    codes = [q.encode_codes(x, shared=reduced, seed=derive_seed(SEED, r, "encode"), shared_seed=ss)
             for r, x in enumerate(xs)]
    if q.max_code is None:
        total = codes[0].clone()
        for c in codes[1:]:
            total += c
    else:
        total = torch.stack([c.to(torch.int64) for c in codes]).sum(0)
    sim = q.decode_codes(total, shared=reduced, count=world, like=xs[0], shared_seed=ss)
    each = _mean([q.decode_codes(c, shared=reduced, count=1, like=xs[0], shared_seed=ss) for c in codes])
    return sim, each


@pytest.fixture(scope="module", params=[2, 4])
def run(request, tmp_path_factory):
    world = request.param
    tmp = str(tmp_path_factory.mktemp(f"w{world}"))
    gradq_testing.spawn_ranks(_child, (world, tmp), world)
    return world, [torch.load(f"{tmp}/out{r}.pt") for r in range(world)]


def test_codes_no_encode_writes_are_refused_after_the_last_collective(run):
    """Without checksums a payload whose codes no encode writes, or whose header does not parse, is
    found by its decode: a protocol called alone refuses it on the rank that decoded it, once its
    collectives are done (no peer waits); ``allreduce_`` agrees on it, so every rank refuses the
    average."""
    world, outs = run
    for r in range(world):
        for alone, agreed in (("invalid|allgather", "invalid|api"), ("invalid|header", "invalid|header-api")):
            err = outs[r][alone]
            assert (err is not None) == (r == 1), (alone, r, err)
            assert err is None or "arrived corrupt" in err, err
            err = outs[r][agreed]
            assert err is not None and "arrived corrupt" in err and "refused on every rank" in err, (agreed, r, err)
        if r == 1:   # the rank that decoded them names the payloads that did not decode
            assert "payload from rank 0" in outs[r]["invalid|header"], outs[r]["invalid|header"]
        # the shared-scale all-reduce: a summed MultiScale index of no scale, on every rank
        err = outs[r]["ms_index|alone"]
        assert isinstance(err, str) and "arrived corrupt" in err, err
        assert outs[r]["ms_index|deferred"] == {"invalid": 1, "finite": True}, outs[r]["ms_index|deferred"]
        assert outs[r]["ms_index|ef"] == {"invalid": 1, "finite": True}, outs[r]["ms_index|ef"]


def test_sum_over_ranks_and_byte_gather(run):
    from gradq.comm._util import SMALL_SUM_BYTES

    world, outs = run
    small = [grad(r, 1000) for r in range(world)]
    want = small[0].clone()
    for x in small[1:]:  # rank order 0..M-1, bit for bit
        want += x
    got, sent = outs[0]["sum_small"]
    assert torch.equal(got, want) and sent == (world - 1) * 4000
    big = torch.stack([grad(r, SMALL_SUM_BYTES // 4 // world + 1) for r in range(world)])
    got, sent = outs[0]["sum_big"]
    # 2 ranks: the ring adds in its own order: equal to float rounding (a few ulps of the largest
    # partial sum); 4 ranks: two all-to-alls, rank order; both send a ring's bytes (to a split's rounding)
    assert torch.allclose(got, big.sum(0), rtol=0, atol=1e-5 * float(big.abs().sum(0).max()))
    ring = 2 * (world - 1) * 4 * big.shape[1] // world
    assert ring <= sent <= ring + 4 * world
    assert torch.equal(outs[0]["max_small"], torch.stack(small).amax(0))  # MAX and MIN are exact in any order
    assert torch.equal(outs[0]["min_big"], big.amin(0))
    for n in (10, SMALL_SUM_BYTES // world + 5):
        for r in range(world):
            blocks = outs[r][f"gather_bytes|{n}"]
            assert [b.numel() for b in blocks] == [n + m for m in range(world)]
            assert all(bool((b == m + 1).all()) for m, b in enumerate(blocks))


def _rank_order(xs: list) -> torch.Tensor:
    out = xs[0].clone()
    for x in xs[1:]:
        out += x
    return out


def test_mid_sized_sums_and_mixed_segments(run):
    """Up to TWO_ROUND_BYTES with more than 2 ranks: two all-to-alls, a ring's bytes, added in rank
    order (bit for bit, on every rank); beyond, the backend's ring (equal to float rounding). One
    vector may mix MAX, SUM and MIN segments on every path."""
    from gradq.comm._util import TWO_ROUND_BYTES

    world, outs = run
    mid = [grad(r, TWO_ROUND_BYTES // 4 - 3) for r in range(world)]
    huge = [grad(r, TWO_ROUND_BYTES // 4 + 1) for r in range(world)]
    n = mid[0].numel()
    for r in range(world):
        got, sent = outs[r]["sum_mid"]
        if world > 2:
            assert torch.equal(got, _rank_order(mid)), r
            mine = n // world + (1 if r < n % world else 0)
            assert sent == ((n - mine) + (world - 1) * mine) * 4
        else:  # 2 ranks: 2 MiB over one all-to-all is over SMALL_SUM_BYTES, so the ring
            assert torch.allclose(got, _rank_order(mid), rtol=0, atol=1e-5 * float(torch.stack(mid).abs().sum(0).max()))
        got, sent = outs[r]["sum_huge"]
        assert torch.allclose(got, _rank_order(huge), rtol=0, atol=1e-5 * float(torch.stack(huge).abs().sum(0).max()))
        assert sent == 2 * (world - 1) * 4 * huge[0].numel() // world
    small = [grad(r, 1000) for r in range(world)]
    for label, xs in (("small", small), ("mid", mid), ("huge", huge)):
        stack = torch.stack(xs)
        for r in range(world):
            got, _ = outs[r][f"segments|{label}"]
            assert torch.equal(got[:7], stack[:, :7].amax(0)) and torch.equal(got[-7:], stack[:, -7:].amin(0))
            body = _rank_order([x[7:-7] for x in xs])
            if label == "huge":
                assert torch.allclose(got[7:-7], body, rtol=0, atol=1e-5 * float(stack.abs().sum(0).max()))
            else:
                assert torch.equal(got[7:-7], body), (label, r)


def test_extra_vector_rides_with_the_statistics(run):
    """shared_scale_allreduce_many(extra=...): the same averages as without, and the extra's sum over
    ranks (rank order while it shares the statistics' one all-to-all)."""
    world, outs = run
    for k in (10, 70_000):
        extra = [grad(r, k) for r in range(world)]
        for r in range(world):
            with_extra, total, without = outs[r][f"extra|{k}"]
            assert all(torch.equal(a, b) for a, b in zip(with_extra, without)), (k, r)
            if k == 10 or world > 2:
                assert torch.equal(total, _rank_order(extra)), (k, r)
            else:
                assert torch.allclose(total, _rank_order(extra), rtol=0, atol=1e-5 * float(torch.stack(extra).abs().sum(0).max()))


def test_many_tensors_in_one_shared_scale_allreduce_equal_separate_calls(run):
    """Also with ``outs=``: the averages written into the tensors given (the fields' decode straight
    there; a cast's copied)."""
    world, outs = run
    for spec in ("terngrad", "maxnorm:bits=2", "multiscale", "fp16"):
        for r in range(world):
            together, apart = outs[r][f"many|{spec}"]
            assert all(torch.equal(a, b) for a, b in zip(together, apart)), (spec, r)
        for r in range(world):   # outs=: the same averages, in the tensors given (fp16: copied there)
            got, into, at, cats = outs[r][f"outs|{spec}"]
            assert all(torch.equal(a, b) for a, b in zip(got, outs[r][f"many|{spec}"][0])), (spec, r)
            assert at[:2] == into[:2] and at[2] != into[2], (spec, r)
            # 1,306 values concatenated: the cast's codes and MultiScale's scale indices (statistics);
            # the fields lie in one buffer, reduced there
            assert cats.count(1306) == (spec in ("fp16", "multiscale")), (spec, cats)


def test_all_ranks_identical(run):
    world, outs = run
    for key, val in outs[0].items():
        if key.startswith(("info|", "api", "sum_", "max_", "min_", "gather_bytes", "many|", "outs|", "segments|",
                           "extra|", "invalid|")) or key == "mismatch":
            continue  # per-rank figures; the allreduce_ entries are compared in their own test
        for r in range(1, world):
            if isinstance(val, torch.Tensor):
                assert torch.equal(val, outs[r][key]), (key, r)
            else:
                assert val == outs[r][key], (key, r)


def test_protocols_decode_under_the_shared_seeds_they_chose(run, monkeypatch):
    """Rand-K's payloads carry their shared seed; the all-gather, scatter (both phases) and
    parameter-server protocols chose it, and decode with it instead of reading each payload's field
    (the count is not blind: a plain decode counts)."""
    world, outs = run
    keys = [_key(*c) for c in cases() if c[1].startswith("randk") and c[0] != "allreduce"]
    assert keys and all(out["unseeded|" + k] == 0 for out in outs for k in keys), [
        (k, out["unseeded|" + k]) for out in outs for k in keys]
    unseeded = gradq_testing.count_unseeded_decodes(monkeypatch.setattr)
    q = gradq.build("randk:ratio=0.25")
    q.decode(q.encode(grad(0, 100), seed=1))
    assert unseeded == [1]


def test_allgather_and_ps_exact(run):
    world, outs = run
    for proto, spec, n, kw in cases():
        got = outs[0][_key(proto, spec, n, kw)]
        if proto == "allgather":
            assert torch.equal(got, expect_allgather(spec, n, world)), spec
        elif proto == "ps":
            assert torch.equal(got, expect_ps(spec, n, world, kw.get("requantize", False))), (spec, kw)


def test_scatter_matches_simulation(run):
    world, outs = run
    for proto, spec, n, kw in cases():
        if proto == "scatter":
            exp = expect_scatter(spec, n, world)
            # same operations in the same order: only float rounding may differ
            torch.testing.assert_close(outs[0][_key(proto, spec, n, kw)], exp, rtol=1e-6, atol=1e-6)


def test_allreduce_is_mean_of_decodes(run):
    world, outs = run
    for proto, spec, n, kw in cases():
        if proto != "allreduce":
            continue
        got = outs[0][_key(proto, spec, n, kw)]
        sim, each = expect_allreduce(spec, n, world)
        # decode of the summed codes vs the mean of per-rank decodes: equal up to float32 rounding
        # (|x| <= ~4·(1+rank) ≈ 16, so a few ulps are < 1e-5); bf16 sums round to 8 mantissa bits
        tol = 2e-2 if spec == "bf16" else 1e-5
        torch.testing.assert_close(got, sim, rtol=tol, atol=tol)
        torch.testing.assert_close(got, each, rtol=tol, atol=tol)
        info = outs[0]["info|" + _key(proto, spec, n, kw)]
        q = gradq.build(spec)
        if q.max_code is not None:
            rule = code_dtype(world, q.max_code)
            wire = info["wire_dtype"]
            assert info["code_dtype"] == rule
            # signed codes travel as the (gloo-promoted) rule; the uint8 fields c + s of the fused
            # path are just as wide and hold the sum exactly when 2·M·s <= 255
            assert wire.itemsize == reduce_dtype(rule, "gloo").itemsize
            assert wire == reduce_dtype(rule, "gloo") or (wire == torch.uint8 and 2 * world * q.max_code <= 255)


def test_none_is_exact_mean(run):
    world, outs = run
    for n in SIZES:
        exact = torch.stack([grad(r, n) for r in range(world)]).mean(0)
        for proto, spec, nn, kw in cases():
            if spec == "none" and nn == n:
                # float32 sums of world terms in different orders: rounding only
                torch.testing.assert_close(outs[0][_key(proto, spec, n, kw)], exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", EF_SPECS)
def test_scatter_with_two_error_feedback_memories(run, spec):
    """Both memories carry over between calls; Rand-K's second memory re-encodes under the shared
    seed its encode draws, which every rank decodes with (no payload refused, none decoded without
    its seed)."""
    world, outs = run
    n = 1001
    c = -(-n // world)
    first = [gradq.ErrorFeedback(spec) for _ in range(world)]  # each rank's own memories
    second = [gradq.ErrorFeedback(spec) for _ in range(world)]
    for step in range(2):
        seed = SEED + step
        xs = [torch.cat([grad(r, n) * (step + 1), torch.zeros(c * world - n)]).view(world, c)
              for r in range(world)]
        chunks = []
        for j in range(world):
            ss = derive_seed(seed, None, f"chunk{j}") if first[0].needs_shared_seed else None
            parts = [first[r].decode(first[r].encode(xs[r][j], seed=derive_seed(seed, r, f"chunk{j}"),
                                                     shared_seed=ss, name=f"w#chunk{j}")) for r in range(world)]
            p2 = second[j].encode(_mean(parts), seed=derive_seed(seed, j, "reencode"), name=f"w#avg{j}")
            chunks.append(second[j].decode(p2))
        for out in outs:
            torch.testing.assert_close(out[f"ef|{spec}|{step}"], torch.cat(chunks)[:n], rtol=1e-6, atol=1e-6)
            assert not out[f"info|ef|{spec}|{step}"].get("damaged") and out[f"ef|{spec}|{step}|unseeded"] == 0


def test_refusals(run):
    world, outs = run
    msg = outs[0]["refused"]
    assert msg is not None and "shared_scale_allreduce" in msg and "allgather_mean" in msg
    assert outs[0]["mismatch"] is not None and "numel" in outs[0]["mismatch"]


def test_int8_allreduce_used_when_it_fits(run):
    world, outs = run
    info = outs[0]["info|" + _key("allreduce", "maxnorm:bits=4", 1001, {})]  # s = 7: M·s <= 28
    # one byte per coordinate (uint8 fields c + 7 on the CPU fast path), plus the one float32 scale;
    # both this small go through one all-to-all: (M−1) copies of each
    assert info["wire_dtype"] in (torch.int8, torch.uint8)
    assert info["bytes_sent"] == (world - 1) * 1001 + (world - 1) * 4


def test_code_dtype_never_overflows():
    assert code_dtype(1000, 127) == torch.int32
    assert code_dtype(8, 7) == torch.int8
    assert code_dtype(127, 1) == torch.int8 and code_dtype(128, 1) == torch.int16
    assert code_dtype(258, 127) == torch.int16 and code_dtype(259, 127) == torch.int32
    assert code_dtype(2**40, 127) == torch.int64
    for m in (1, 2, 3, 7, 64, 129, 1000, 5000, 10**6, 10**9):
        for s in (0, 1, 7, 127, 255, 2**15):
            dt = code_dtype(m, s)
            assert torch.iinfo(dt).max >= m * s and torch.iinfo(dt).min <= -m * s
            narrower = {torch.int16: torch.int8, torch.int32: torch.int16, torch.int64: torch.int32}.get(dt)
            assert narrower is None or torch.iinfo(narrower).max < m * s  # the narrowest
    assert reduce_dtype(torch.int16, "gloo") == torch.int32 and reduce_dtype(torch.int8, "gloo") == torch.int8
    with pytest.raises(ValueError):
        code_dtype(0, 7)


def test_derive_seed():
    seeds = {derive_seed(5, r, t) for r in (None, 0, 1, 2) for t in ("encode", "chunk0", 0, 1)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(5, 1, "encode") == derive_seed(5, 1, "encode") != derive_seed(6, 1, "encode")


def test_allreduce_in_place_entry_point(run):
    """gradq.allreduce_ picks the auto protocol, writes the average in place (shape kept), equals a
    direct call of that protocol with the same derived seeds, and agrees on every rank."""
    world, outs = run
    for spec, proto in API_SPECS.items():
        copies, stats = outs[0][f"api|{spec}"]
        assert stats["protocol"] == proto and stats["numel"] == 377 and stats["bytes_sent"] > 0
        assert copies[1].shape == (7, 11)
        for rank in range(world):
            got, _ = outs[rank][f"api|{spec}"]
            for a, b, ref in zip(got, copies, outs[rank][f"apiref|{spec}"]):
                assert torch.equal(a, b) and torch.equal(a, ref)


def test_allreduce_in_place_single_process():
    """Without an initialised process group it quantizes locally (same error as a real run)."""
    x = torch.randn(500, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    stats = gradq.allreduce_(y, "qsgd:bits=2,bucket=100", seed=7, names=["w"])
    q = gradq.build("qsgd:bits=2,bucket=100")
    assert stats == {"protocol": "local", "bytes_sent": 0, "numel": 500}
    assert torch.equal(y, q.decode(q.encode(x, seed=derive_seed(derive_seed(7, None, "w"), 0, "encode"))))
    with pytest.raises(TypeError, match="floating-point"):
        gradq.allreduce_(torch.arange(3), "none")



def test_choose_protocol_rule():
    b = gradq.build
    assert choose_protocol(b("qsgd:bits=4"), 1) == "local"
    assert choose_protocol(b("maxnorm:bits=4"), 4) == "allreduce"          # 4·7 = 28 fits int8
    assert choose_protocol(b("maxnorm:bits=4"), 18) == "allreduce"         # 18·7 = 126
    assert choose_protocol(b("maxnorm:bits=4"), 19) == "scatter"           # 133: would need 4 bytes on gloo
    assert choose_protocol(b("maxnorm:bits=8"), 2) == "scatter"            # 2·127 > 127
    assert choose_protocol(b("terngrad"), 127) == "allreduce" and choose_protocol(b("terngrad"), 128) == "scatter"
    assert choose_protocol(b("none"), 64) == "allreduce"                   # float sums
    assert choose_protocol(b("qsgd:bits=2"), 4) == "scatter"
    assert choose_protocol(b("qsgd:bits=4,coding=elias"), 4) == "allgather"
    assert choose_protocol(b("topk:ratio=0.01"), 4) == "scatter"           # fixed K per chunk
