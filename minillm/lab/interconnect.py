"""Links between accelerators, and what a collective costs on them (the alpha-beta model).

A collective over p ranks is a sequence of messages. Sending n bytes over a link costs a fixed
latency alpha (software, synchronization, the first byte's trip) plus n / B at the link's
bandwidth B (Hockney, 1994). Counting the messages of each algorithm gives its cost
(Thakur, Rabenseifner and Gropp, 2005; Patarasuk and Yuan, 2009):

    ring all-reduce        2 (p - 1) alpha  +  2 (p - 1) / p * n / B
    tree all-reduce        2 ceil(log2 p) (alpha + n / B)     up a binary tree and down again
    ring all-gather        (p - 1) alpha  +  (p - 1) / p * n / B      n: the gathered tensor
    ring reduce-scatter    (p - 1) alpha  +  (p - 1) / p * n / B      n: the tensor before scatter
    all-to-all (direct)    (p - 1) alpha  +  (p - 1) / p * n / B      n: what one rank holds

A ring all-reduce is a reduce-scatter followed by an all-gather: each rank sends and receives
2 (p - 1) / p * n bytes whatever p is, which is optimal in bandwidth, but it takes 2 (p - 1)
steps, each paying alpha. A tree takes only 2 log2 p steps but sends the whole message at each
one: it wins for small messages and loses for large ones. (NCCL pipelines its trees in chunks,
which brings their bandwidth term close to the ring's; this module prices the plain tree.)

Bandwidths are the datasheets' figures per direction; the latencies are not datasheet figures
but assumed orders of magnitude, labelled as such: measure your own with
`minillm.lab.collective_bench`.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

from minillm.lab.kv_offload import pcie_bandwidth_bytes_per_s
from minillm.lab.units import GB

ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True, slots=True)
class Link:
    """What one accelerator can send to its peers: bandwidth per direction and a latency."""

    name: str
    bandwidth_bytes_per_s: float  # one direction, one GPU, all its lanes or links together
    latency_s: float  # alpha: the fixed cost of one message step (assumed, see latency_source)
    source: str  # where the bandwidth comes from
    source_date: str  # its date, YYYY-MM
    latency_source: str = "assumed order of magnitude, not a vendor figure"

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(
                f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth_bytes_per_s}, "
                f"{self.latency_s}"
            )


_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: NVLink 900 GB/s, PCIe Gen5 128 GB/s, "
    "both directions together), "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: NVLink 600 GB/s, PCIe Gen4 64 GB/s, "
    "both directions together), https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_PCIE_SOURCE = (
    "PCI-SIG base specifications: 16 GT/s (Gen4) and 32 GT/s (Gen5) per lane, 128b/130b "
    "encoding; x16, one direction (minillm.lab.kv_offload.pcie_bandwidth_bytes_per_s)"
)

LINKS: types.MappingProxyType[str, Link] = types.MappingProxyType(
    {
        link.name: link
        for link in (
            Link(
                # 18 fourth-generation NVLinks, 900 GB/s counting both directions.
                name="NVLink 4 (H100/H200 SXM)",
                bandwidth_bytes_per_s=900 * GB / 2,
                latency_s=3e-6,
                source=_H100_SOURCE,
                source_date="2023-09",
            ),
            Link(
                name="NVLink 3 (A100 SXM)",
                bandwidth_bytes_per_s=600 * GB / 2,
                latency_s=3e-6,
                source=_A100_SOURCE,
                source_date="2021-06",
            ),
            Link(
                name="PCIe Gen5 x16",
                bandwidth_bytes_per_s=pcie_bandwidth_bytes_per_s(5),
                latency_s=10e-6,
                source=_PCIE_SOURCE,
                source_date="2019-05",
            ),
            Link(
                name="PCIe Gen4 x16",
                bandwidth_bytes_per_s=pcie_bandwidth_bytes_per_s(4),
                latency_s=10e-6,
                source=_PCIE_SOURCE,
                source_date="2017-10",
            ),
            Link(
                # One 400 Gb/s port per GPU, the usual rail of a multi-node cluster.
                name="InfiniBand NDR 400G",
                bandwidth_bytes_per_s=400e9 / 8,
                latency_s=20e-6,
                source="NVIDIA ConnectX-7 and Quantum-2 NDR InfiniBand: 400 Gb/s per port",
                source_date="2022-03",
            ),
        )
    }
)


def link_names() -> list[str]:
    """Names `get_link` accepts."""
    return list(LINKS)


def get_link(name: str) -> Link:
    """The link called `name` (case-insensitive)."""
    for key, link in LINKS.items():
        if key.lower() == name.lower():
            return link
    raise ValueError(f"unknown link {name!r}; expected one of {link_names()}")


def _check(num_bytes: float, num_ranks: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    if not num_bytes >= 0 or not math.isfinite(num_bytes):
        raise ValueError(f"num_bytes must be a finite number >= 0, got {num_bytes!r}")


def ring_all_reduce_bytes_per_rank(num_bytes: float, num_ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `num_bytes`:
    2 (p - 1) / p * n, a reduce-scatter and an all-gather of (p - 1) / p * n each."""
    _check(num_bytes, num_ranks)
    return 2 * (num_ranks - 1) / num_ranks * num_bytes


def all_reduce_time_s(
    num_bytes: float, num_ranks: int, link: Link, algorithm: str = "ring"
) -> float:
    """Seconds for an all-reduce of `num_bytes` (the tensor on each rank) over `num_ranks`.

    ring: 2 (p - 1) alpha + 2 (p - 1) / p * n / B
    tree: 2 ceil(log2 p) (alpha + n / B)
    One rank needs no communication: 0 seconds.
    """
    _check(num_bytes, num_ranks)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if num_ranks == 1:
        return 0.0
    if algorithm == "ring":
        steps = 2 * (num_ranks - 1)
        return (
            steps * link.latency_s
            + ring_all_reduce_bytes_per_rank(num_bytes, num_ranks) / link.bandwidth_bytes_per_s
        )
    levels = math.ceil(math.log2(num_ranks))
    return 2 * levels * (link.latency_s + num_bytes / link.bandwidth_bytes_per_s)


def all_reduce_crossover_bytes(num_ranks: int, link: Link) -> float:
    """The message size above which a ring all-reduce beats the plain tree.

    Equal times: 2(p-1) a + 2(p-1)/p n/B = 2 L (a + n/B) with L = ceil(log2 p)
    =>  n = a B ((p - 1) - L) / (L - (p - 1)/p). For p = 2 both are one exchange each way
    and the ring never loses: 0.
    """
    _check(0, num_ranks)
    if num_ranks <= 2:
        return 0.0
    levels = math.ceil(math.log2(num_ranks))
    steps_saved = (num_ranks - 1) - levels
    bytes_factor = levels - (num_ranks - 1) / num_ranks
    return max(0.0, link.latency_s * link.bandwidth_bytes_per_s * steps_saved / bytes_factor)


def all_gather_time_s(gathered_bytes: float, num_ranks: int, link: Link) -> float:
    """Ring all-gather: every rank ends with the whole `gathered_bytes` tensor, of which it
    held 1/p. (p - 1) alpha + (p - 1) / p * n / B."""
    _check(gathered_bytes, num_ranks)
    if num_ranks == 1:
        return 0.0
    fraction = (num_ranks - 1) / num_ranks
    return (num_ranks - 1) * link.latency_s + fraction * gathered_bytes / link.bandwidth_bytes_per_s


def reduce_scatter_time_s(num_bytes: float, num_ranks: int, link: Link) -> float:
    """Ring reduce-scatter: each rank holds `num_bytes` and ends with the sum of 1/p of it.
    The same messages as an all-gather, run the other way: (p - 1) alpha + (p - 1)/p n / B."""
    return all_gather_time_s(num_bytes, num_ranks, link)


def all_to_all_time_s(bytes_per_rank: float, num_ranks: int, link: Link) -> float:
    """All-to-all: each rank holds `bytes_per_rank`, split evenly by destination, and keeps its
    own 1/p share. (p - 1) alpha + (p - 1) / p * n / B."""
    return all_gather_time_s(bytes_per_rank, num_ranks, link)


def transfer_time_s(num_bytes: float, link: Link, num_links: int = 1) -> float:
    """One point-to-point transfer of `num_bytes` split over `num_links` links used at once
    (each rank of a tensor-parallel group sending its shard): alpha + n / (links * B)."""
    _check(num_bytes, num_links)
    return link.latency_s + num_bytes / (num_links * link.bandwidth_bytes_per_s)
