"""Named networks and clusters for the performance model, with where every number comes from.

Parameter counts are exact for the architectures named (AlexNet and the VGGs are built layer by layer
below). **Compute times are assumptions** — neither paper prints its profiled times — chosen as typical
fp32 forward + backward times of the GPU generation each paper used; measure your own and pass
``compute_ms`` (``--compute-ms``). Cluster bandwidths between nodes are the papers'; intra-node
bandwidths and all latencies are assumptions, stated per preset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .components import Cluster, Model
from .units import PerfModelError, format_rate, parse_rate

__all__ = ["NETWORKS", "CLUSTERS", "NetworkPreset", "network", "cluster", "describe_presets"]


def _alexnet_layers() -> tuple[int, ...]:
    """AlexNet as in the original two-GPU model (grouped conv2/4/5), weight then bias per layer."""
    convs = [(96, 3 * 11 * 11), (256, 48 * 5 * 5), (384, 256 * 3 * 3), (384, 192 * 3 * 3), (256, 192 * 3 * 3)]
    fcs = [(4096, 256 * 6 * 6), (4096, 4096), (1000, 4096)]
    out: list[int] = []
    for o, fan_in in convs + fcs:
        out += [o * fan_in, o]
    return tuple(out)


def _vgg_layers(cfg: list[int], fc_in: int = 512 * 7 * 7, classes: int = 1000, fc: int = 4096) -> tuple[int, ...]:
    """VGG: 3×3 convolutions with the output widths in ``cfg`` (pooling carries no parameters) then
    three fully connected layers; weight then bias per layer."""
    out: list[int] = []
    c_in = 3
    for c in cfg:
        out += [c * c_in * 9, c]
        c_in = c
    for o, i in ((fc, fc_in), (fc, fc), (classes, fc)):
        out += [o * i, o]
    return tuple(out)


@dataclass(frozen=True)
class NetworkPreset:
    """A named network: parameter count, assumed compute time, batch size per GPU, sources."""

    params: int
    compute_ms: float
    batch_size: int
    layer_sizes: Optional[tuple[int, ...]] = None
    messages: Optional[int] = None
    note: str = ""

    def model(self, name: str) -> Model:
        """This preset as a :class:`Model` named ``name``."""
        return Model(params=self.params, compute_ms=self.compute_ms, batch_size=self.batch_size,
                     layer_sizes=self.layer_sizes, messages=self.messages, name=name)


_ALEX = _alexnet_layers()
_VGG_A = _vgg_layers([64, 128, 256, 256, 512, 512, 512, 512])
_VGG16 = _vgg_layers([64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512])

#: networks by name. Batch sizes: [TernGrad] figure 5 (AlexNet 128, GoogLeNet 64, VggNet-A 32 per GPU),
#: [Vineeth] §5 (128 per worker on CIFAR-10); compute times: assumptions (see each note).
NETWORKS: dict[str, NetworkPreset] = {
    "alexnet": NetworkPreset(sum(_ALEX), 60.0, 128, _ALEX, note=(
        "60,965,224 params (244 MB fp32), 16 tensors; batch 128 ([TernGrad] fig. 5); compute 60 ms "
        "assumed (~2,100 img/s, GTX 1080 class)")),
    "googlenet": NetworkPreset(6_800_000, 130.0, 64, None, 1, note=(
        "~6.8M params (Inception v1 paper's count; [TernGrad] says GoogLeNet), layer sizes not modelled; "
        "batch 64 ([TernGrad] fig. 5); compute 130 ms assumed (~500 img/s, GTX 1080 class)")),
    "vgg-a": NetworkPreset(sum(_VGG_A), 160.0, 32, _VGG_A, note=(
        "VggNet-A = VGG-11, 132,863,336 params, 22 tensors; batch 32 ([TernGrad] fig. 5); compute 160 ms "
        "assumed (~200 img/s, GTX 1080 class)")),
    "vgg16": NetworkPreset(sum(_VGG16), 290.0, 32, _VGG16, note=(
        "138,357,544 params (553 MB fp32), 32 tensors; batch 32 assumed; compute 290 ms assumed "
        "(~110 img/s, GTX 1080 class)")),
    "resnet50": NetworkPreset(25_557_032, 180.0, 64, None, 161, note=(
        "25,557,032 params in 161 tensors (ImageNet ResNet-50); batch 64 assumed; compute 180 ms "
        "assumed (~360 img/s fp32, V100 class)")),
    "resnet50-cifar": NetworkPreset(23_520_842, 50.0, 128, None, 161, note=(
        "23,520,842 params in 161 tensors ([Vineeth] appendix B, CIFAR-10); batch 128 ([Vineeth] §5); "
        "compute 50 ms assumed (V100 class, 32x32 inputs)")),
    "vgg16-cifar": NetworkPreset(14_728_266, 20.0, 128, None, 54, note=(
        "14,728,266 params in 54 tensors ([Vineeth] appendix B, CIFAR-10, with batch norm); batch 128 "
        "([Vineeth] §5); compute 20 ms assumed (V100 class, 32x32 inputs)")),
}

#: clusters by name; inter-node bandwidth and GPUs per node from the papers, the rest assumed.
CLUSTERS: dict[str, Cluster] = {
    "1gbit-ethernet": Cluster(
        bandwidth=parse_rate("1gbit"), latency_s=50e-6, gpus_per_node=4, intra_bandwidth=parse_rate("10GB/s"),
        intra_latency_s=5e-6, name="1gbit-ethernet", note=(
            "[TernGrad] fig. 5(a): 4 GPUs per node on one PCI switch, 1 Gbit/s Ethernet; assumed: "
            "PCIe peer-to-peer 10 GB/s, 5 us intra latency, 50 us TCP latency")),
    "10gbit-ethernet": Cluster(
        bandwidth=parse_rate("10gbit"), latency_s=30e-6, gpus_per_node=4, intra_bandwidth=parse_rate("25GB/s"),
        intra_latency_s=3e-6, name="10gbit-ethernet", note=(
            "[Vineeth] §5.6: 4 V100 per node with NVLink, 10 Gbit/s Ethernet; assumed: NVLink 25 GB/s "
            "(one NVLink 2.0 link per direction), 3 us intra latency, 30 us TCP latency")),
    "100gbit-infiniband": Cluster(
        bandwidth=parse_rate("100gbit"), latency_s=2e-6, gpus_per_node=4, intra_bandwidth=parse_rate("40GB/s"),
        intra_latency_s=3e-6, name="100gbit-infiniband", note=(
            "[TernGrad] fig. 5(b): 4 P100 per node via NVLink, 100 Gbit/s InfiniBand; assumed: NVLink "
            "40 GB/s (two NVLink 1.0 links), 3 us intra latency, 2 us InfiniBand latency")),
}


def _lookup(table: dict, kind: str, name: str):
    key = str(name).strip().lower()
    if key not in table:
        raise PerfModelError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    return key, table[key]


def network(name: str, **overrides) -> Model:
    """The preset network ``name`` as a :class:`Model`; ``overrides`` replace fields (``compute_ms=…``).

    Raises:
        PerfModelError: unknown name (the message lists the valid ones).
    """
    key, preset = _lookup(NETWORKS, "network", name)
    return replace(preset.model(key), **overrides)


def cluster(name: str, **overrides) -> Cluster:
    """The preset cluster ``name``; ``overrides`` replace fields (``bandwidth=…`` in bytes/s).

    Raises:
        PerfModelError: unknown name (the message lists the valid ones).
    """
    _, preset = _lookup(CLUSTERS, "cluster", name)
    return replace(preset, **overrides)


def describe_presets() -> str:
    """Every preset network and cluster, one per line, with its values and sources."""
    lines = ["networks (--network):"]
    for k, p in NETWORKS.items():
        lines.append(f"  {k:15s} {p.params / 1e6:7.2f}M params, {p.compute_ms:g} ms/iter, batch {p.batch_size}"
                     f" — {p.note}")
    lines.append("clusters (--cluster):")
    for k, c in CLUSTERS.items():
        lines.append(f"  {k:19s} {c.gpus_per_node} GPUs/node, inter {format_rate(c.bandwidth)} "
                     f"({c.latency_s * 1e6:g} us), intra {format_rate(c.intra_bandwidth or 0)} "
                     f"({c.intra_latency_s * 1e6:g} us) — {c.note}")
    return "\n".join(lines)
