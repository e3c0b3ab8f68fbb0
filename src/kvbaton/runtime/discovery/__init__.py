"""Discovery backends behind one interface, chosen by URL."""

from __future__ import annotations

from urllib.parse import urlparse

from kvbaton.runtime.discovery.base import Discovery, PrefixWatch, WatchEvent
from kvbaton.runtime.discovery.file import FileDiscovery
from kvbaton.runtime.discovery.mem import MemDiscovery

__all__ = [
    "Discovery",
    "FileDiscovery",
    "MemDiscovery",
    "PrefixWatch",
    "WatchEvent",
    "open_discovery",
]


def open_discovery(url: str) -> Discovery:
    """`mem://name`, `file:///abs/dir`, a bare directory path,
    `etcd://host:port[,host:port...][/key-prefix]`, or `kubernetes[://NAMESPACE][?api=URL]`."""
    parsed = urlparse(url)
    if url == "kubernetes" or parsed.scheme == "kubernetes":
        from kvbaton.runtime.discovery.kubernetes import KubernetesDiscovery  # (aiohttp)

        return KubernetesDiscovery.from_url(url)
    if parsed.scheme == "etcd":
        from kvbaton.runtime.discovery.etcd import EtcdDiscovery  # grpc loads only when used

        return EtcdDiscovery.from_url(url)
    if parsed.scheme == "mem":
        return MemDiscovery(parsed.netloc or parsed.path or "default")
    if parsed.scheme == "file":
        path = parsed.netloc + parsed.path
        if not path:
            raise ValueError(f"file discovery URL {url!r} names no directory")
        return FileDiscovery(path)
    if parsed.scheme == "" and url:
        return FileDiscovery(url)
    raise ValueError(
        f"unknown discovery backend {url!r}; supported: file:///dir, mem://name, "
        "etcd://host:port[,host:port...][/prefix], kubernetes[://NAMESPACE][?api=URL]"
    )
