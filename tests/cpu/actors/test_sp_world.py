"""Where an SP world's members meet (`actors.sp_world.rendezvous`): on one node a file in a
folder only its user may enter, so no store listens on the network; across nodes a TCP store."""

import os
import stat
from urllib.parse import urlparse

from stepserve.actors.sp_world import rendezvous


def test_one_nodes_world_meets_in_a_private_file_and_listens_on_nothing():
    first, second = rendezvous(one_node=True), rendezvous(one_node=True)
    assert first.startswith("file://") and first != second  # a world rebuilt meets somewhere new
    folder = os.path.dirname(urlparse(first).path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.listdir(folder) == []
    for url in (first, second):
        os.rmdir(os.path.dirname(urlparse(url).path))


def test_a_world_over_several_nodes_meets_at_a_tcp_store():
    url = urlparse(rendezvous(one_node=False))
    assert url.scheme == "tcp" and url.hostname == "127.0.0.1" and url.port > 0  # (no Ray here: this host)
