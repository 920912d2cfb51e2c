"""Separate "hosts" on one machine for tests: a network namespace per host on a bridge the test
makes, each with its own address (198.18.<n>.0/24, a benchmarking range nothing else uses), and
processes started there in their own IPC namespace with a private /dev/shm, so nothing passes
between hosts but the network. Everything is removed on close(). Needs root (`ip netns`)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time


def can_make_hosts() -> str:
    """"" when this machine can make namespaces, else why not (for a skip message)."""

    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    probe = f"kvbprobe{os.getpid() % 10000}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return ""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _subnets_in_use() -> set[int]:
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    return {int(part.split(".")[2]) for part in out.split() if part.startswith("198.18.")}


class Hosts:
    def __init__(self, names: list[str]) -> None:
        rng = random.SystemRandom()  # never the seeded global random: runs at once must not collide
        self.tag = f"kvb{rng.randrange(10**4):04d}"
        used = _subnets_in_use()
        self.subnet = rng.choice([n for n in range(1, 250) if n not in used])
        self.bridge = f"{self.tag}br"
        self.names = list(names)
        self.made: list[str] = []
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            self.made.append("bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(self.names, 1):
                ns = self.namespace(name)
                _ip("netns", "add", ns)
                self.made.append(ns)
                outside, inside = f"{self.tag}{index}h", f"{self.tag}{index}n"
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                self.made.append("veth:" + outside)
                _ip("link", "set", outside, "master", self.bridge, "up")
                _ip("link", "set", inside, "netns", ns)
                _ip("-n", ns, "link", "set", inside, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @property
    def gateway(self) -> str:
        """This (the test's) side of the bridge."""
        return f"198.18.{self.subnet}.254"

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"198.18.{self.subnet}.{self.names.index(name) + 1}"

    def prefix(self, name: str) -> list[str]:
        """Run a command on host `name`: its network namespace, its own IPC namespace and a
        private /dev/shm."""

        return ["ip", "netns", "exec", self.namespace(name), "unshare", "--ipc", "--mount",
                "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$0" "$@"']

    def kill_all(self, name: str) -> None:
        """SIGKILL every process on host `name` (a host that dies)."""

        out = subprocess.run(["ip", "netns", "pids", self.namespace(name)], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        for name in self.names:
            if self.namespace(name) in self.made:
                self.kill_all(name)
        time.sleep(0.2)
        for made in self.made:
            if made.startswith("veth:"):  # gone with its namespace, unless it never got there
                subprocess.run(["ip", "link", "del", made[5:]], capture_output=True, timeout=20)
            elif made != "bridge":
                subprocess.run(["ip", "netns", "del", made], capture_output=True, timeout=20)
        if "bridge" in self.made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)
        self.made.clear()
