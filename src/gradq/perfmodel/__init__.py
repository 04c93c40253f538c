r"""Performance model: predicted time per iteration and throughput of data-parallel training with
compressed gradients, at scales one machine cannot run (docs/algorithms.md).

The idea is [TernGrad]'s (TernGrad, section 5 and its supplementary material, which extends Yan et al.,
KDD 2015): combine lightweight profiling on one machine (compute time, codec time) with an analytical
model of communication; [Vineeth] (section 5.6, figures 11–14) reuses it with the tree formula below.
Pure arithmetic: nothing here measures anything; a gradq spec is only asked for its wire size.

    from gradq import perfmodel as pm
    p = pm.predict("alexnet", "terngrad", "1gbit-ethernet", workers=64, speedup=True)
    rows = pm.sweep("vgg16", ["none", "maxnorm:bits=4"], "10gbit-ethernet")   # 1, 2, 4, …, 512 GPUs
    print(pm.format_table(rows)); pm.plot_sweep(rows, "vgg16.png")

Command line (wired as ``gradq perfmodel``; also ``python -m gradq.perfmodel``)::

    gradq perfmodel --gradient-mb 100 --compute-ms 0 --workers 4 --bandwidth 1gbit --compressor none --json
    gradq perfmodel --network alexnet --cluster 1gbit-ethernet -c none -c terngrad --sweep --plot a.png

Notation
--------
``n`` gradient coordinates (fp32 gradient ``4n`` bytes; 1 MB = 10⁶ bytes); ``b`` wire bits per
coordinate including scales and headers (a gradq spec: ``b = 8·Σ_l expected_nbytes(n_l)/n`` over the
parameter tensors; ``"none"``/``"fp32"``: exactly 32); ``S = n·b/8`` bytes, one worker's compressed
gradient (for ``allreduce`` with ``sum_bits`` set, ``b = sum_bits``: codes widened for the integer
sum); ``M`` GPUs, ``G`` GPUs per node, ``g = min(M, G)`` GPUs used per node, ``N = ceil(M/G)`` nodes
(a partial last node is modelled as full, an upper bound); ``B_n, α_n`` inter-node bandwidth (per node
link, full duplex) and latency per message; ``B_i, α_i`` the same inside a node; ``L`` collective calls
per iteration (one per parameter tensor for presets with layer sizes, else 1); ``k`` parameter servers.

Communication, ``formula="ring"`` (default; the one the CLI uses unless ``--formula paper002``)
------------------------------------------------------------------------------------------------
α–β model (Hockney): a step that sends ``x`` bytes takes ``α + x/B``. Two levels: a ring inside each
node, then a ring across nodes through each node's link.

* ``allreduce`` (ring all-reduce, docs/algorithms.md, 2(M−1)/M·S per worker in 2(M−1) steps) and
  ``scatter`` (scatter-reduce/all-gather of packed codes: the same volume at the compressed size)::

      t_intra = 2(g−1)·L·α_i + 2(g−1)/g · S/B_i
      t_inter = 2(N−1)·L·α_n + 2(N−1)/N · S/B_n

  (intra-node reduce-scatter, N-node all-reduce of each GPU's 1/g shard — the g shards share the
  node link, so the link carries 2(N−1)/N·S — then intra-node all-gather). Flat network (G = 1):
  ``2(M−1)·L·α + 2(M−1)/M · S/B``; e.g. fp32, 100 MB, M = 4, 1 Gbit/s, α = 0: 1.5·10⁸·8/10⁹ = 1.2 s.
* ``allgather`` (every worker receives the other M−1 payloads)::

      t_inter = (N−1)·(L·α_n + g·S/B_n)        t_intra = (g−1)·(L·α_i + N·S/B_i)

  flat: ``(M−1)·(L·α + S/B)``, i.e. (M−1)·S per worker.
* ``ps`` (one dedicated server, or k sharing the gradient; [TernGrad], [OptQuant]): every worker pushes S,
  the server link carries M·S/k in, then M·S'/k out, with S' = 4n (fp32 pull, default) or S
  (``ps_requantize``); a node link carries g·S::

      t_inter = 2·L·α_n + (max(M·S/k, g·S) + max(M·S'/k, g·S'))/B_n

  ``ps_pull_bits`` sets ``S' = n·bits/8`` instead; ``"summed"`` is [TernGrad]'s exchange (scaler
  sharing, parameter localization): the sum of M shared-scale codes, ``log2(2·M·s + 1)`` bits.

  (gradq.comm.ps colocates the server with a worker, which moves (M−1)·S instead of M·S.)

Communication, ``formula="paper002"`` ([Vineeth], all-reduce and scatter only)
------------------------------------------------------------------------------
``t_comm = S/B_i · log2(g) + (L·α_n + S/B_n) · log2(N)`` — a reduction tree inside the node and one
across nodes, as in [Vineeth]'s ``S/B_intra·log2(G_node) + (α + S/B_net)·log2(N_nodes)``; log2 is taken
as ceil(log2) tree levels (equal for powers of two); it has no intra-node latency term.

Codec (measured time of ONE encode ``e`` / decode ``d`` of the whole gradient:
``encode_ms + encode_ms_per_mb · 4n/10⁶``, the same for decode; zero for the fp32 baseline)
-----------------------------------------------------------------------------------------
The per-MB times come from measurement: ``codec_times`` (``--codec-times FILE``) reads the JSON of
``benchmarks/bench_codecs.py --memory --json FILE`` (:mod:`gradq.perfmodel.codec_times`); the CLI's
default is the CPU measurement shipped with gradq (2 cores, numba), which overstates a GPU's codec
time. Explicit ``--encode-ms…`` values win; a spec the file lacks gets 0 and the output says so.

Critical-path counts per iteration: ``allreduce`` e + d; ``scatter`` (1 + 1/M)·e + 2·d (encode, decode
M chunks = one gradient, re-encode one chunk, decode the gathered chunks); ``allgather`` e + M·d (every
worker decodes all M); ``ps`` e + (M/k)·d at the server, plus e/k + d when re-quantized. With M = 1
nothing is communicated and no codec runs. gradq's scatter pipelines segments so that part of its
codec hides behind the transfers; the model does not credit that (an upper bound).

Iteration time and throughput
-----------------------------
Without overlap (default, as [Vineeth]'s formula): ``T = t_compute + t_encode + t_decode + t_comm``.
With overlap, communication hides behind the last fraction ``f`` of the compute (the backward pass;
default f = 2/3 [assumption]), while the codec competes with compute for the GPU and does not hide
[decided]::

    T = t_encode + t_decode + (1 − f)·t_compute + max(f·t_compute, t_comm)

(f = 1 gives ``t_codec + max(t_compute, t_comm)``). A measured **communication floor** ``t_floor`` (``comm_floor_ms``,
default 0) bounds the communication from below: ``t_comm ← max(t_comm, t_floor)``. It is the time one
iteration's collectives take on a link so fast that their bytes cost nothing — synchronising the
workers and the software cost of each collective — measured for the same compressor, model and worker
count (``benchmarks/validate_perfmodel.py --floor-from``); the max, not a sum, because that cost
overlaps the transfers once they are slow [decided from the emulated-network runs,
docs/performance.md]. A floor measured at one worker count is not scaled to others. The fp32 baseline
of ``speedup_vs_fp32`` has no floor. Throughput = ``M · batch / T`` samples/s with a
batch size per GPU, else ``1/T`` iterations/s. ``speedup_vs_fp32 = T_fp32 / T`` with the same
protocol, formula, cluster and overlap. ``protocol="auto"`` picks as gradq.comm.choose_protocol:
``allreduce`` for summable codes while M·s ≤ 127 (fp32 and widths given as ``"4bit"`` included),
else ``scatter``.

Break-even bandwidth
--------------------
``break_even_bandwidth`` (``--break-even``): the inter-node bandwidth at which a compressor and fp32
(same protocol and options) take equally long per iteration; compression pays below it. Only the
``S/B`` terms depend on the bandwidth and the compressor's ``S`` is smaller, while its codec time and
floor do not shrink, so ``T_fp32 − T`` never grows with ``B`` and a bisection on ``log B`` finds it.

Presets (:mod:`gradq.perfmodel.presets`) give exact parameter counts, the papers' batch sizes and
cluster bandwidths, and ASSUMED compute times, intra-node bandwidths and latencies; every value can be
overridden. Validate against measured runs (:func:`validate`) before trusting a projection.
"""

from .cli import add_arguments, main, parse_workers, run
from .codec_times import DEFAULT_CODEC_TIMES, CodecTimes, codec_times_from, load_codec_times
from .components import Cluster, Compressor, Model, compressor_from
from .core import (BREAK_EVEN_RANGE, CONFIG_KEYS, DEFAULT_OVERLAP_FRACTION, DEFAULT_SWEEP, FORMULAS, PROTOCOLS,
                   CommCost, Prediction, break_even_bandwidth, codec_factors, comm_cost, predict, predict_config,
                   resolve_protocol, setup, sweep)
from .presets import CLUSTERS, NETWORKS, cluster, describe_presets, network
from .report import Validation, format_table, plot_sweep, validate
from .units import MB, PerfModelError, format_rate, parse_rate

__all__ = [
    "Model", "Compressor", "Cluster", "Prediction", "CommCost", "Validation", "PerfModelError",
    "predict", "sweep", "predict_config", "setup", "comm_cost", "codec_factors", "resolve_protocol",
    "compressor_from", "format_table", "plot_sweep", "validate", "network", "cluster", "describe_presets",
    "parse_rate", "format_rate", "parse_workers", "add_arguments", "run", "main",
    "NETWORKS", "CLUSTERS", "PROTOCOLS", "FORMULAS", "DEFAULT_SWEEP", "DEFAULT_OVERLAP_FRACTION",
    "CONFIG_KEYS", "MB", "CodecTimes", "load_codec_times", "codec_times_from", "DEFAULT_CODEC_TIMES",
    "break_even_bandwidth", "BREAK_EVEN_RANGE",
]
