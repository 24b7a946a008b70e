"""A Ray placement group reserving one bundle per worker rank."""

from __future__ import annotations

import logging
from typing import Any

from easyrl.distributed.errors import ResourceUnavailableError
from easyrl.distributed.torch_dist import is_loopback


__all__ = ["ResourcePool", "rendezvous_host"]

logger = logging.getLogger(__name__)

_HINT = (
    "set trainer.nnodes and trainer.n_gpus_per_node to what the cluster has (on a CPU machine n_gpus_per_node is "
    "the number of CPU worker processes), or start Ray with more resources"
)


class ResourcePool:
    """One placement group of ``nnodes * n_per_node`` bundles, one per rank; created and waited for on construction.

    Each bundle is ``{"GPU": 1, "CPU": cpus_per_bundle}`` when ``use_gpu`` else ``{"CPU": cpus_per_bundle}``.
    Several :class:`~easyrl.distributed.WorkerGroup` s (actor, ref, critic...) may share a pool: each asks every
    bundle for a fraction of its resources.

    Args:
        nnodes: number of nodes.
        n_per_node: bundles (ranks) per node.
        use_gpu: whether each bundle holds a GPU.
        cpus_per_bundle: CPUs in each bundle.
        timeout_s: how long to wait for the placement group before giving up.
        name: an optional name for the placement group.

    Raises:
        ResourceUnavailableError: the cluster does not have the resources, or they did not free up in time.
    """

    def __init__(
        self,
        nnodes: int,
        n_per_node: int,
        use_gpu: bool,
        *,
        cpus_per_bundle: float = 1.0,
        timeout_s: float = 60.0,
        name: str = "",
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if nnodes < 1 or n_per_node < 1:
            raise ValueError(f"a resource pool needs nnodes >= 1 and n_per_node >= 1, got {nnodes} and {n_per_node}")
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call easyrl.distributed.init_ray() first")
        self.nnodes = nnodes
        self.n_per_node = n_per_node
        self.use_gpu = use_gpu
        self.world_size = nnodes * n_per_node
        self.bundle: dict[str, float] = {"GPU": 1.0, "CPU": cpus_per_bundle} if use_gpu else {"CPU": cpus_per_bundle}
        self._check_cluster()
        strategy = "STRICT_PACK" if nnodes == 1 else "PACK"
        self.placement_group = placement_group([dict(self.bundle) for _ in range(self.world_size)], strategy, name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            raise ResourceUnavailableError(
                f"the placement group of {self.world_size} bundles {self.bundle} ({strategy}) was not ready after "
                f"{timeout_s:g} s: the cluster has the resources but they are held by other placement groups or "
                f"actors (available now: {_summary(ray.available_resources(), self.bundle)})"
            )
        self._bundle_nodes = self._read_bundle_nodes()
        logger.info(
            "resource pool ready: %d bundles %s (%s) on %d node(s)",
            self.world_size,
            self.bundle,
            strategy,
            len(set(self._bundle_nodes)),
        )

    def _check_cluster(self) -> None:
        """Fail fast, with a hint, when the cluster cannot hold the pool at all."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        for resource, per_bundle in self.bundle.items():
            asked = per_bundle * self.world_size
            total = sum(float(n["Resources"].get(resource, 0.0)) for n in nodes)
            unit = f"{resource}s" if resource in ("GPU", "CPU") else resource
            if asked > total:
                raise ResourceUnavailableError(
                    f"asked for {asked:g} {unit}, the Ray cluster has {total:g}: {_HINT} (asked: {self.nnodes} "
                    f"node(s) x {self.n_per_node} worker(s) x {per_bundle:g} {resource})"
                )
            per_node = per_bundle * self.n_per_node
            fitting = sum(1 for n in nodes if float(n["Resources"].get(resource, 0.0)) >= per_node)
            if fitting < self.nnodes:
                largest = max((float(n["Resources"].get(resource, 0.0)) for n in nodes), default=0.0)
                raise ResourceUnavailableError(
                    f"asked for {self.nnodes} node(s) with {per_node:g} {unit} each, the Ray cluster has {fitting} "
                    f"such node(s) (the largest has {largest:g}): {_HINT}"
                )

    def _read_bundle_nodes(self) -> list[str]:
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.placement_group)
        mapping: dict[Any, str] = table.get("bundles_to_node_id", {}) or {}
        return [str(mapping.get(i, mapping.get(str(i), ""))) for i in range(self.world_size)]

    @property
    def bundle_node_ids(self) -> list[str]:
        """The Ray node id hosting each bundle, by bundle index."""
        return list(self._bundle_nodes)

    def local_ranks(self) -> list[int]:
        """Each bundle's index among the bundles on the same node (the workers' ``LOCAL_RANK``)."""
        seen: dict[str, int] = {}
        ranks = []
        for node in self._bundle_nodes:
            ranks.append(seen.get(node, 0))
            seen[node] = seen.get(node, 0) + 1
        return ranks

    def node_ip(self, bundle_index: int) -> str:
        """The IP address of the node hosting bundle ``bundle_index``."""
        return self.node_ips()[bundle_index]

    def node_ips(self) -> list[str]:
        """The IP address of the node hosting each bundle, by bundle index (as the nodes registered with Ray)."""
        import ray

        addresses = {str(node.get("NodeID")): str(node["NodeManagerAddress"]) for node in ray.nodes()}
        here = str(ray.util.get_node_ip_address())
        return [addresses.get(node_id, here) for node_id in self._bundle_nodes]

    def rendezvous_host(self) -> str:
        """Where rank 0 hosts the ``torch.distributed`` rendezvous store: see :func:`rendezvous_host`."""
        return rendezvous_host(self.node_ips())

    def remove(self) -> None:
        """Release the placement group (the groups using it should be shut down first)."""
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.placement_group)
        except Exception:  # already removed or Ray shut down
            logger.debug("removing the placement group failed", exc_info=True)

    def __repr__(self) -> str:
        return f"ResourcePool(nnodes={self.nnodes}, n_per_node={self.n_per_node}, bundle={self.bundle})"


def rendezvous_host(node_ips: list[str]) -> str:
    """The address every rank reaches rank 0's rendezvous store at: rank 0's node address as Ray knows it.

    On one node that is 127.0.0.1 for easyrl's private Ray instance (the store then listens on loopback only, see
    :func:`~easyrl.distributed.torch_dist.init_distributed`); across nodes it is the address the other nodes
    joined Ray with, which they can reach. A loopback address on a pool that spans hosts would make every other
    rank wait for the rendezvous until its timeout, so it is refused here.

    Raises:
        ResourceUnavailableError: rank 0's node registered with a loopback address and other ranks are on
            other hosts.
    """
    host = node_ips[0]
    others = sorted(set(node_ips) - {host})
    if is_loopback(host) and others:
        raise ResourceUnavailableError(
            f"rank 0's Ray node has the address {host}, which the ranks on {', '.join(others)} cannot reach: "
            "start that node's Ray with --node-ip-address=<an address the other nodes reach>"
        )
    return host


def _summary(resources: dict[str, float], bundle: dict[str, float]) -> dict[str, float]:
    """The entries of a Ray resource dict for the resources of ``bundle`` (0 when absent)."""
    return {k: float(resources.get(k, 0.0)) for k in bundle}
