"""Free TCP ports for processes that share this machine's ports (loopback rehearsal nodes).

The scheme, and why:
- Below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
  default), as 29500 is on the nodes. The kernel gives ports of that range to every outgoing
  connection (and binding port 0 draws from it): a port found free there can be taken as the
  source port of some connection between the check and the moment torchrun binds it, and a
  client that retries connecting to a loopback port of that range before its server listens
  can be given that very port as its own source port and connect to itself (a TCP
  self-connect), which then keeps the server from binding it. Nothing but an explicit bind
  takes a port below the range.
- Chosen at random among the about 22,000 ports from 10000 up to the range, with every port
  the caller needs (`offsets` from the first) bound once as a check. A port is released
  before its user binds it (torchrun cannot take over a socket), so two runs on one machine
  (two test processes, two rehearsals) could still choose the same port in that moment; a
  random choice over the whole block makes that one chance in about 22,000 per pair of
  choices made at once, where binding port 0 makes it likely (the kernel hands out nearby
  ports in turn), and a port in use by the other run is refused by the check.
- Never the same port twice in one process: a port handed out earlier may still be held by
  a listener that is ending or by connections in TIME_WAIT.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from pathlib import Path

from scripts.cluster_lib import ClusterError

LOWEST = 10000
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_given: set[int] = set()
_lock = threading.Lock()
_random = random.SystemRandom()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc does not say)."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(*offsets: int) -> int:
    """A port P below the ephemeral range with P and P + each offset free (preflight's
    --port, +1 and +2, say); never one this process was given before."""
    low = ephemeral_low()
    span = max((0, *offsets))
    for _ in range(500):
        port = _random.randrange(LOWEST, low - span)
        wanted = {port + offset for offset in (0, *offsets)}
        with _lock:
            if wanted & _given:
                continue
            try:
                with contextlib.ExitStack() as stack:
                    for each in sorted(wanted):
                        sock = stack.enter_context(socket.socket())
                        sock.bind(("", each))
            except OSError:
                continue
            _given.update(wanted)
        return port
    raise ClusterError(f"no free ports {offsets} apart below {low}")
