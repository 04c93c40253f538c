"""The performance model's arithmetic against hand-computed cases (gradq.perfmodel).

Conventions in the comments: 1 MB = 1e6 bytes, 1 Gbit/s = 1.25e8 bytes/s, S = compressed gradient
bytes, M workers. Times are compared with a relative tolerance of 1e-9: the model is a handful of
float operations, so only rounding (~1e-16 relative) separates it from the exact values.
"""

from __future__ import annotations

import json

import pytest

import gradq
from gradq import perfmodel as pm
from gradq.perfmodel import Cluster, Compressor, Model, PerfModelError

REL = 1e-9  # see the module docstring
GBIT = 1.25e8  # bytes/s


def approx(x: float) -> object:
    return pytest.approx(x, rel=REL, abs=1e-12)


def flat(rate: str = "1gbit", latency_s: float = 0.0) -> Cluster:
    return Cluster(bandwidth=pm.parse_rate(rate), latency_s=latency_s)


def two_level(latency_s: float = 0.0, intra_latency_s: float = 0.0) -> Cluster:
    # 4 GPUs per node, 10 GB/s inside a node, 1 Gbit/s between nodes
    return Cluster(bandwidth=GBIT, latency_s=latency_s, gpus_per_node=4, intra_bandwidth=1e10,
                   intra_latency_s=intra_latency_s)


M100 = Model.from_mb(100)  # 25e6 coordinates, 1e8 bytes


# -- communication volumes --------------------------------------------------------------------------------
def test_fp32_ring_allreduce_100mb_4_workers_1gbit():
    # 2·(M−1)/M · S / B = 2·3/4 · 1e8 B · 8 / 1e9 bit/s = 1.2 s
    p = pm.predict(M100, "none", flat(), 4)
    assert p.comm_ms == approx(1200.0)
    assert p.iteration_ms == approx(1200.0)
    assert p.bytes_per_worker == approx(1.5e8)   # 2·3/4 · 1e8
    assert p.bits == 32.0 and p.encode_ms == 0 and p.decode_ms == 0


def test_ring_allreduce_latency_per_message():
    # + 2(M−1)·L·α = 2·3·10·50 µs = 3 ms on top of 1200 ms
    m = Model.from_mb(100, messages=10)
    assert pm.predict(m, "none", flat(latency_s=50e-6), 4).comm_ms == approx(1203.0)
    # one message: + 2·3·50 µs = 0.3 ms
    assert pm.predict(M100, "none", flat(latency_s=50e-6), 4).comm_ms == approx(1200.3)


def test_allgather_volume():
    # (M−1)·S / B = 3 · 1e8 / 1.25e8 = 2.4 s; with α = 1 ms and L = 2 messages: + (M−1)·L·α = 6 ms
    p = pm.predict(M100, "none", flat(), 4, protocol="allgather")
    assert p.comm_ms == approx(2400.0) and p.bytes_per_worker == approx(3e8)
    m = Model.from_mb(100, messages=2)
    assert pm.predict(m, "none", flat(latency_s=1e-3), 4, protocol="allgather").comm_ms == approx(2406.0)
    # two levels, M=8 on 4-GPU nodes (g=4, N=2): inter (N−1)·g·S/B_n = 4e8/1.25e8 = 3.2 s,
    # intra (g−1)·N·S/B_i = 3·2·1e8/1e10 = 60 ms; per worker (M−1)·S = 7e8 bytes
    p = pm.predict(M100, "none", two_level(), 8, protocol="allgather")
    assert (p.inter_comm_ms, p.intra_comm_ms, p.bytes_per_worker) == (approx(3200.0), approx(60.0), approx(7e8))


def test_parameter_server_volumes():
    # fp32: push M·S/B = 4e8/1.25e8 = 3.2 s, pull the same in fp32 → 6.4 s
    assert pm.predict(M100, "none", flat(), 4, protocol="ps").comm_ms == approx(6400.0)
    # 2-bit: S = 25e6·2/8 = 6.25e6; push 4·6.25e6/1.25e8 = 0.2 s; pull fp32 3.2 s → 3.4 s
    assert pm.predict(M100, "2bit", flat(), 4, protocol="ps").comm_ms == approx(3400.0)
    # re-quantized pull: 0.2 s + 0.2 s
    assert pm.predict(M100, "2bit", flat(), 4, protocol="ps", ps_requantize=True).comm_ms == approx(400.0)
    # two servers: each link carries M·S/2 = 2e8 → 1.6 s each way
    assert pm.predict(M100, "none", flat(), 4, protocol="ps", ps_servers=2).comm_ms == approx(3200.0)


def test_two_level_ring():
    # M=8, G=4 → g=4, N=2. intra 2·3/4·1e8/1e10 = 15 ms; inter 2·1/2·1e8/1.25e8 = 800 ms
    p = pm.predict(M100, "none", two_level(), 8)
    assert (p.intra_comm_ms, p.inter_comm_ms, p.nodes) == (approx(15.0), approx(800.0), 2)
    # latencies: + 2·3·10 µs = 0.06 ms intra, + 2·1·1 ms = 2 ms inter
    p = pm.predict(M100, "none", two_level(latency_s=1e-3, intra_latency_s=1e-5), 8)
    assert p.comm_ms == approx(817.06)
    # M=512 → N=128: inter 2·127/128·800 = 1587.5 ms, + 15 ms intra
    assert pm.predict(M100, "none", two_level(), 512).comm_ms == approx(1602.5)
    # one node (M=4): intra only, 15 ms
    assert pm.predict(M100, "none", two_level(), 4).comm_ms == approx(15.0)


def test_two_level_paper002_tree_formula():
    # S/B_i·log2(g) + (α + S/B_n)·log2(N): M=8 → 1e8/1e10·2 + (0 + 0.8)·1 = 20 + 800 ms
    assert pm.predict(M100, "none", two_level(), 8, formula="paper002").comm_ms == approx(820.0)
    # α_n = 1 ms adds α·log2(N) = 1 ms; the formula has no intra-node latency term
    c = two_level(latency_s=1e-3, intra_latency_s=1e-5)
    assert pm.predict(M100, "none", c, 8, formula="paper002").comm_ms == approx(821.0)
    # M=512 → N=128: 20 + 7·800 = 5620 ms
    assert pm.predict(M100, "none", two_level(), 512, formula="paper002").comm_ms == approx(5620.0)
    with pytest.raises(PerfModelError, match="all-reduce"):
        pm.predict(M100, "none", two_level(), 8, formula="paper002", protocol="allgather")


# -- compressors -------------------------------------------------------------------------------------------
def test_four_bit_compressor():
    # S = 25e6·4/8 = 12.5e6 B; 2·3/4·12.5e6/1.25e8 = 0.15 s; speedup over fp32 = 1200/150 = 8
    p = pm.predict(M100, "4bit", flat(), 4, speedup=True)
    assert p.bits == 4.0 and p.comm_ms == approx(150.0) and p.speedup_vs_fp32 == approx(8.0)
    # a gradq spec: bits = 8·expected_nbytes(n)/n, scales and header included
    n = M100.params
    c = pm.compressor_from("maxnorm:bits=4", M100)
    assert c.bits == approx(8 * gradq.build("maxnorm:bits=4").expected_nbytes(n) / n)
    assert 4.0 < c.bits < 4.0001
    # per layer: every tensor pays its own header and scale
    m = Model(params=300, layer_sizes=(100, 200))
    q = gradq.build("terngrad")
    assert pm.compressor_from("terngrad", m).bits == approx(8 * (q.expected_nbytes(100) + q.expected_nbytes(200)) / 300)


def test_sum_bits_and_protocol_choice():
    # all-reduce of int8-widened codes: 8 bits → 300 ms; scatter keeps the packed 4 bits → 150 ms
    c = pm.compressor_from("4bit", M100, sum_bits=8)
    assert pm.predict(M100, c, flat(), 4).comm_ms == approx(300.0)
    assert pm.predict(M100, c, flat(), 4, protocol="scatter").comm_ms == approx(150.0)
    with pytest.raises(PerfModelError, match="cannot be summed"):
        pm.predict(M100, "qsgd:bits=4,bucket=512", flat(), 4)
    assert pm.predict(M100, "qsgd:bits=4,bucket=512", flat(), 4, protocol="auto").protocol == "scatter"
    # maxnorm 4-bit has s = 7: all-reduce while 7·M ≤ 127, i.e. up to M = 18
    assert pm.predict(M100, "maxnorm:bits=4", flat(), 16, protocol="auto").protocol == "allreduce"
    assert pm.predict(M100, "maxnorm:bits=4", flat(), 32, protocol="auto").protocol == "scatter"
    with pytest.raises(PerfModelError, match="data-dependent"):
        pm.compressor_from("qsgd:bits=4,coding=elias", M100)
    with pytest.raises(PerfModelError, match="valid"):
        pm.compressor_from("nosuchscheme", M100)


def test_codec_counts_per_protocol():
    # 0.5 ms/MB encode, 0.2 ms/MB decode on a 100 MB gradient: e = 50 ms, d = 20 ms
    c = Compressor(name="q", bits=4, encode_ms_per_mb=0.5, decode_ms_per_mb=0.2)
    p = pm.predict(M100, c, flat(), 4)                          # e + d
    assert (p.encode_ms, p.decode_ms) == (approx(50.0), approx(20.0))
    p = pm.predict(M100, c, flat(), 4, protocol="scatter")      # (1 + 1/4)·e + 2·d
    assert (p.encode_ms, p.decode_ms) == (approx(62.5), approx(40.0))
    p = pm.predict(M100, c, flat(), 4, protocol="allgather")    # e + 4·d
    assert (p.encode_ms, p.decode_ms) == (approx(50.0), approx(80.0))
    p = pm.predict(M100, Compressor(name="q", bits=4, encode_ms=10, decode_ms=5), flat(), 4, protocol="ps",
                   ps_requantize=True)                          # (1 + 1)·e, (4 + 1)·d
    assert (p.encode_ms, p.decode_ms) == (approx(20.0), approx(25.0))
    assert pm.predict(M100, c, flat(), 1).iteration_ms == 0.0   # one worker: no comm, no codec


# -- iteration time ----------------------------------------------------------------------------------------
def test_overlap_on_and_off():
    m = Model.from_mb(100, compute_ms=300)
    # off: 300 + 1200; on (f = 2/3): (1/3)·300 + max(200, 1200) = 1300; f = 1: max(300, 1200)
    assert pm.predict(m, "none", flat(), 4).iteration_ms == approx(1500.0)
    assert pm.predict(m, "none", flat(), 4, overlap=True).iteration_ms == approx(1300.0)
    assert pm.predict(m, "none", flat(), 4, overlap=True, overlap_fraction=1.0).iteration_ms == approx(1200.0)
    # 100 Gbit/s: comm = 1.5e8/1.25e10 = 12 ms, hidden: 100 + max(200, 12) = 300; off: 312
    assert pm.predict(m, "none", flat("100gbit"), 4, overlap=True).iteration_ms == approx(300.0)
    assert pm.predict(m, "none", flat("100gbit"), 4).iteration_ms == approx(312.0)
    # the codec (5 + 7 ms) never hides: 312 on, 324 off
    c = Compressor(name="q", bits=32, encode_ms=5, decode_ms=7)
    assert pm.predict(m, c, flat("100gbit"), 4, overlap=True).iteration_ms == approx(312.0)
    assert pm.predict(m, c, flat("100gbit"), 4).iteration_ms == approx(324.0)


def test_communication_floor():
    m = Model.from_mb(100, compute_ms=300)
    # 1 Gbit/s: the ring's 1200 ms exceeds a 50 ms floor, which then changes nothing: 300 + 1200
    assert pm.predict(m, "none", flat(), 4, comm_floor_ms=50).iteration_ms == approx(1500.0)
    # 100 Gbit/s: 12 ms of transfers < 50 ms floor: comm = 50, iteration = 350 (overlap: 100 + max(200, 50))
    p = pm.predict(m, "none", flat("100gbit"), 4, comm_floor_ms=50)
    assert p.comm_ms == approx(50.0) and p.iteration_ms == approx(350.0)
    assert pm.predict(m, "none", flat("100gbit"), 4, comm_floor_ms=50, overlap=True).iteration_ms == approx(300.0)
    # one worker communicates nothing, floor or not
    assert pm.predict(m, "none", flat(), 1, comm_floor_ms=50).comm_ms == 0.0
    # the config path and the CLI flag carry it; a negative floor is refused
    cfg = {"gradient_mb": 100, "compute_ms": 300, "bandwidth": "100gbit", "workers": 4, "comm_floor_ms": 50}
    assert pm.predict_config(cfg).iteration_ms == approx(350.0)
    with pytest.raises(PerfModelError, match="comm_floor_ms"):
        pm.predict(m, "none", flat(), 4, comm_floor_ms=-1)


def test_cli_comm_floor(capsys):
    rc = pm.main(["--gradient-mb", "100", "--compute-ms", "300", "--workers", "4", "--bandwidth", "100gbit",
                  "--comm-floor-ms", "50", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["comm_ms"] == approx(50.0)


def test_throughput():
    m = Model.from_mb(100, compute_ms=300, batch_size=128)
    p = pm.predict(m, "none", flat(), 4, overlap=True)        # T = 1300 ms
    assert p.throughput == approx(4 * 128 / 1.3) and p.throughput_unit == "samples/s"
    p = pm.predict(Model.from_mb(100, compute_ms=300), "none", flat(), 4, overlap=True)
    assert p.throughput == approx(1 / 1.3) and p.throughput_unit == "iterations/s"


def test_sweep_and_table():
    rows = pm.sweep(M100, ["none", "4bit"], flat())
    assert [r.workers for r in rows[:10]] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] and len(rows) == 20
    # 2(M−1)/M·S/B at M = 512: 2·511/512·800 ms
    assert rows[9].comm_ms == approx(2 * 511 / 512 * 800)
    table = pm.format_table(rows)
    assert len(table.splitlines()) == 22 and "| 4bit" in table


# -- presets -----------------------------------------------------------------------------------------------
def test_presets_and_overrides():
    assert pm.network("alexnet").params == 60_965_224      # ≈ 61M, 243.9 MB fp32
    assert pm.network("vgg16").params == 138_357_544
    assert pm.network("vgg-a").params == 132_863_336
    assert pm.network("alexnet").n_messages == 16
    m, c = pm.setup(network="alexnet", compute_ms=10, cluster="1gbit-ethernet", bandwidth="10gbit", latency_us=0)
    assert (m.compute_ms, m.batch_size, m.layer_sizes is not None) == (10.0, 128, True)
    assert (c.bandwidth, c.latency_s, c.gpus_per_node) == (1.25e9, 0.0, 4)
    m, _ = pm.setup(network="alexnet", gradient_mb=100, bandwidth="1gbit")
    assert (m.params, m.layer_sizes, m.n_messages) == (25_000_000, None, 16)
    with pytest.raises(PerfModelError, match="alexnet.*vgg16"):
        pm.network("resnet")
    with pytest.raises(PerfModelError, match="100gbit-infiniband"):
        pm.cluster("2gbit")


# -- inputs ------------------------------------------------------------------------------------------------
def test_rate_parser():
    assert pm.parse_rate("1gbit") == 1.25e8
    assert pm.parse_rate("10gbit") == 1.25e9
    assert pm.parse_rate("100mbit") == 1.25e7
    assert pm.parse_rate("125MB/s") == 1.25e8
    assert pm.parse_rate("1.25GB/s") == 1.25e9
    assert pm.parse_rate("25Gbit/s") == 3.125e9
    assert pm.parse_rate("1Gb/s") == 1.25e8
    assert pm.parse_rate("1GiB/s") == 2.0**30
    assert pm.parse_rate(5e6) == 5e6                          # numbers are bytes/s
    for bad, why in (("1gbps", "ambiguous"), ("fast", "cannot read"), ("1", "cannot read"),
                     ("0gbit", "positive"), ("-1gbit", "cannot read")):
        with pytest.raises(PerfModelError, match=why):
            pm.parse_rate(bad)


def test_bad_inputs_say_what_to_fix():
    with pytest.raises(PerfModelError, match="size"):
        Model.from_mb(-1)
    with pytest.raises(PerfModelError, match="params"):
        Model(params=0)
    with pytest.raises(PerfModelError, match="compute_ms"):
        Model(params=10, compute_ms=-1)
    with pytest.raises(PerfModelError, match="layer sizes sum"):
        Model(params=10, layer_sizes=(3, 4))
    with pytest.raises(PerfModelError, match="intra-bandwidth"):
        Cluster(bandwidth=GBIT, gpus_per_node=4)
    with pytest.raises(PerfModelError, match="workers"):
        pm.predict(M100, "none", flat(), 0)
    with pytest.raises(PerfModelError, match="allreduce, scatter, allgather, ps"):
        pm.predict(M100, "none", flat(), 4, protocol="butterfly")
    with pytest.raises(PerfModelError, match=r"\[0, 1\]"):
        pm.predict(M100, "none", flat(), 4, overlap=True, overlap_fraction=1.5)
    with pytest.raises(PerfModelError, match="--bandwidth"):
        pm.setup(gradient_mb=100)
    with pytest.raises(PerfModelError, match="--network"):
        pm.setup(bandwidth="1gbit")


# -- validation --------------------------------------------------------------------------------------------
def test_validate():
    rows = [{"workers": 4, "measured_ms": 1500.0, "measured_comm_ms": 1000.0, "label": "fp32 x4"},
            {"workers": 2, "measured_ms": 800.0}]
    v = pm.validate(rows, {"gradient_mb": 100, "bandwidth": "1gbit", "compressor": "none"})
    # M=4: predicted 1200 → (1200 − 1500)/1500 = −20 %; comm (1200 − 1000)/1000 = +20 %
    # M=2: 2·1/2·1e8/1.25e8 = 800 ms → 0 %
    assert v.rows[0]["rel_error"] == approx(-0.2) and v.rows[0]["comm_rel_error"] == approx(0.2)
    assert v.rows[1]["predicted_ms"] == approx(800.0) and v.rows[1]["rel_error"] == approx(0.0)
    assert v.mean_abs_rel_error == approx(0.1) and v.max_abs_rel_error == approx(0.2)
    assert "-20.0%" in v.markdown and "fp32 x4" in v.markdown
    with pytest.raises(PerfModelError, match="unknown key"):
        pm.validate([{"workers": 4, "measured_ms": 1.0, "run_dir": "x"}], {"gradient_mb": 1, "bandwidth": "1gbit"})
    v = pm.validate([{"workers": 4, "measured_ms": 1.0, "run_dir": "x"}], {"gradient_mb": 1, "bandwidth": "1gbit"},
                    strict=False)
    assert len(v.rows) == 1
    with pytest.raises(PerfModelError, match="measured_ms"):
        pm.validate([{"workers": 4}], {"gradient_mb": 1, "bandwidth": "1gbit"})


# -- command line ------------------------------------------------------------------------------------------
def test_cli_json(capsys):
    rc = pm.main(["--gradient-mb", "100", "--compute-ms", "0", "--workers", "4", "--bandwidth", "1gbit",
                  "--protocol", "allreduce", "--compressor", "none", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["comm_ms"] == approx(1200.0) and out["iteration_ms"] == approx(1200.0)
    assert out["throughput"] == approx(1000 / 1200) and out["throughput_unit"] == "iterations/s"
    assert out["config"]["workers"] == 4


def test_cli_sweep_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    rc = pm.main(["--network", "alexnet", "--cluster", "1gbit-ethernet", "-c", "none", "-c", "terngrad",
                  "--sweep", "1,2,4,8", "--speedup", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and "| terngrad" in out and "speedup vs fp32" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = pm.main(["--params", "1000", "--bandwidth", "1gbit", "--sweep", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rc == 0 and [r["workers"] for r in rows] == list(pm.DEFAULT_SWEEP)


def test_cli_errors(capsys):
    assert pm.main(["--gradient-mb", "100", "--bandwidth", "1gbps"]) == 2
    assert "ambiguous" in capsys.readouterr().err
    assert pm.main(["--gradient-mb", "-5", "--bandwidth", "1gbit"]) == 2
    assert "must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # argparse lists the valid presets
        pm.main(["--network", "resnet", "--bandwidth", "1gbit"])
    assert "alexnet" in capsys.readouterr().err
    assert pm.main(["--list-presets"]) == 0
    assert "100gbit-infiniband" in capsys.readouterr().out


def test_allreduce_is_charged_the_width_the_protocol_sums():
    """gradq's shared-scale all-reduce sums one byte per coordinate (fields c + s while 2·M·s ≤ 255),
    else a wider integer (int16 is sent as int32 on gloo and NCCL): not the packed payload's bits.
    Its shared statistics travel too (one float32 scale for these unbucketed tensors, and MultiScale's
    byte of scale index a coordinate); a GlobalRandK variant sums its K selected codes only."""
    from gradq.comm.allreduce import summed_itemsize

    assert summed_itemsize(8, 1, fields=True) == 1          # TernGrad, 8 workers
    assert summed_itemsize(16, 7, fields=True) == 1         # 4-bit MaxNorm: 2·16·7 = 224
    assert summed_itemsize(32, 7, fields=True) == 4         # 448: int16, sent as int32
    assert summed_itemsize(100, 1, fields=False) == 1       # MultiScale's codes (s1 = 1): int8
    scale = 32 / M100.params
    assert pm.predict(M100, "terngrad", flat(), 8).bits == pytest.approx(8.0 + scale, rel=1e-12)
    assert pm.predict(M100, "maxnorm:bits=4", flat(), 32, protocol="allreduce").bits == pytest.approx(32.0 + scale,
                                                                                                      rel=1e-12)
    assert pm.predict(M100, "multiscale", flat(), 8).bits == pytest.approx(16.0 + scale, rel=1e-12)
    assert pm.predict(M100, "randk-maxnorm:ratio=0.01", flat(), 8).bits == pytest.approx(0.08 + scale, rel=1e-12)
    assert pm.predict(M100, "randk-multiscale:ratio=0.01", flat(), 8).bits == pytest.approx(0.16 + scale, rel=1e-12)
    # the TernGrad paper's AlexNet on 8 GPUs at 1 Gbit/s: the 1.6 bits of the packed trits projected
    # 12.7x over fp32, which the protocol does not send; summing bytes, the projection is below 4x
    sp = pm.predict("alexnet", "terngrad", "1gbit-ethernet", 8, speedup=True).speedup_vs_fp32
    assert 3.0 < sp < 4.0, sp


# -- measured codec times, break-even bandwidth, the TernGrad exchange --------------------------------------
def _times_file(tmp_path, rows, **extra):
    doc = {"format": "gradq-codec-times/1", "device": "cpu", "device_name": "test CPU", "n": 25_000_000,
           "input_mb": 100.0, "copy_ms": 5.0, "rows": rows, **extra}
    path = tmp_path / "times.json"
    path.write_text(json.dumps(doc))
    return path


def test_codec_times_are_read_per_mb_and_found_under_any_spelling(tmp_path):
    path = _times_file(tmp_path, [{"spec": "maxnorm:bits=4", "encode_ms": 20.0, "decode_ms": 5.0}])
    times = pm.load_codec_times(path)
    assert times.lookup("maxnorm:bits=4") == (0.2, 0.05)          # ms per MB of fp32 input
    assert times.lookup(gradq.build("maxnorm:bits=4").spec) == (0.2, 0.05)
    assert times.lookup("maxnorm:bits=2") is None
    # allreduce, M = 4: one encode and one decode of the 100 MB gradient: 20 ms and 5 ms
    p = pm.predict(M100, "maxnorm:bits=4", flat(), 4, codec_times=path)
    assert (p.encode_ms, p.decode_ms) == (approx(20.0), approx(5.0))
    assert "test CPU" in p.codec_source
    # explicit times win over the file; an unmeasured spec gets none, and says so
    c = pm.compressor_from("maxnorm:bits=4", M100, times, encode_ms=1.0)
    assert (c.encode_ms, c.encode_ms_per_mb, c.codec_source) == (1.0, 0.0, "given")
    c = pm.compressor_from("maxnorm:bits=2", M100, times)
    assert c.encode_ms_per_mb == 0.0 and c.codec_source.startswith("not measured")
    assert pm.predict(M100, "none", flat(), 4, codec_times=path).encode_ms == 0.0   # fp32: no codec


def test_codec_times_take_the_encode_the_hook_makes(tmp_path):
    """A GPU file also holds the encode without the NaN/Inf check, which is the one the DDP hook
    makes (it screens the bucket itself), and the decode with its checks deferred, as the hook's
    protocols decode: those times are the projection's, where a row has them."""
    path = _times_file(tmp_path, [{"spec": "maxnorm:bits=4", "encode_ms": 20.0, "decode_ms": 5.0,
                                   "encode_unchecked_ms": 12.0},
                                  {"spec": "terngrad", "encode_ms": 20.0, "decode_ms": 5.0,
                                   "decode_deferred_ms": 3.0}])
    assert pm.load_codec_times(path).lookup("maxnorm:bits=4") == (0.12, 0.05)
    assert pm.load_codec_times(path).lookup("terngrad") == (0.2, 0.03)


@pytest.mark.parametrize("which, device", [("default", "CPU"), ("h100", "H100"), ("h200", "H200")])
def test_shipped_codec_times_cover_the_papers_schemes(which, device):
    times = pm.codec_times_from(which)
    assert device in times.device_name
    for spec in ("terngrad", "maxnorm:bits=2", "maxnorm:bits=4", "maxnorm:bits=8", "multiscale:bits=2+6",
                 "randk-maxnorm:ratio=0.01,bits=4", "qsgd:bits=4,bucket=512"):
        enc, dec = times.lookup(spec)
        assert enc > 0 and dec > 0, spec
    assert pm.codec_times_from("none") is None


@pytest.mark.parametrize("bad, match", [("{", "not JSON"), ('{"format": "other"}', "not a codec-times file"),
                                        ('{"format": "gradq-codec-times/1", "input_mb": 100, "rows": [{}]}',
                                         "every row")])
def test_bad_codec_times_files_are_refused(tmp_path, bad, match):
    path = tmp_path / "bad.json"
    path.write_text(bad)
    with pytest.raises(PerfModelError, match=match):
        pm.load_codec_times(path)
    with pytest.raises(PerfModelError, match="cannot read"):
        pm.load_codec_times(tmp_path / "missing.json")


def test_break_even_bandwidth_matches_the_closed_form():
    # flat, M = 2, all-reduce: t = S/B. fp32: 4n/B; "4bit": e + d + n/(2B). Equal at B* = 3.5n/(e + d).
    c = Compressor(name="4bit", bits=4.0, encode_ms=6.0, decode_ms=4.0)
    bstar = 3.5 * M100.params / 10e-3
    got = pm.break_even_bandwidth(M100, c, flat(), 2)
    assert got == pytest.approx(bstar, rel=1e-3)   # the bisection stops at 0.1 %
    assert pm.predict(M100, c, flat(), 2, break_even=True).break_even_bandwidth == got
    # no codec cost: compression pays at every bandwidth; one node: the network is not used
    assert pm.break_even_bandwidth(M100, Compressor(name="4bit", bits=4.0), flat(), 2) == float("inf")
    assert pm.break_even_bandwidth(M100, c, two_level(), 4) is None
    # a codec slower than any transfer it saves: never pays over the searched range
    slow = Compressor(name="31bit", bits=31.0, encode_ms=1e9)
    assert pm.break_even_bandwidth(M100, slow, flat(), 2) == 0.0


def test_terngrad_parameter_server_exchange_pulls_log2_of_2Ms_plus_1_bits():
    import math

    # ps, M = 8 on a flat network: push M·S, pull M·S' through the server's link; S' at log2(17) bits
    n = M100.params
    p = pm.predict(M100, "terngrad", flat(), 8, protocol="ps", ps_pull_bits="summed")
    push, pull = 8 * n * p.bits / 8, 8 * n * math.log2(17) / 8   # p.bits: 1.6 plus the scale's share
    assert p.comm_ms == approx(1e3 * (push + pull) / GBIT)
    q = pm.predict(M100, "terngrad", flat(), 8, protocol="ps", ps_pull_bits=3)
    assert q.comm_ms == approx(1e3 * (push + 8 * n * 3 / 8) / GBIT)
    with pytest.raises(PerfModelError, match="shared-scale"):
        pm.predict(M100, "signsgd", flat(), 8, protocol="ps", ps_pull_bits="summed")
    with pytest.raises(PerfModelError, match="ps_pull_bits"):
        pm.predict(M100, "terngrad", flat(), 8, protocol="ps", ps_pull_bits="many")


def test_cli_break_even_and_codec_times(capsys, tmp_path):
    path = _times_file(tmp_path, [{"spec": "terngrad", "encode_ms": 10.0, "decode_ms": 10.0}])
    assert pm.main(["--network", "alexnet", "--cluster", "1gbit-ethernet", "-c", "none", "-c", "terngrad",
                    "--workers", "8", "--sweep", "8", "--speedup", "--break-even", "--codec-times", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pays below" in out and "Gbit/s" in out and "test CPU" in out
    assert pm.main(["--gradient-mb", "100", "--bandwidth", "1gbit", "-w", "4", "-c", "terngrad",
                    "--codec-times", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["encode_ms"] == 0.0
