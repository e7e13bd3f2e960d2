"""What a node's heartbeat lists of its bans, and to whom it hands its proofs
(``PeersMixin._ban_list``, ``_hand_over_bans``)."""

from types import SimpleNamespace

from peer.node.peers import PeersMixin
from protocol.identity import Identity, peer_id_from_public_key
from protocol.messages_swarm import MAX_HEARTBEAT_BANS

KEYS = [Identity.from_seed(bytes([i]) * 32).public_key for i in range(1, 20)]


class Node(PeersMixin):
    def __init__(self, banned: list[bytes], peers: dict):
        self.bans = SimpleNamespace(items=lambda: [SimpleNamespace(peer_id=peer_id_from_public_key(k)) for k in banned])
        self._peers, self._partners, self.sent = peers, {}, []
        self.averager = SimpleNamespace(audits=SimpleNamespace(gossip=lambda lacking, *a, **kw: lacking))
        self.net = SimpleNamespace(submit=self.sent.append)


def hb(banned=(), state="training"):
    return SimpleNamespace(banned=tuple(banned), state=state)


def test_the_heartbeat_lists_the_latest_bans_first_and_at_most_its_limit():
    node = Node(KEYS[:12], {})
    assert node._ban_list() == tuple(reversed(KEYS[:12]))[:MAX_HEARTBEAT_BANS]


def test_proofs_go_to_peers_whose_lists_leave_the_ban_out_unless_the_list_is_full():
    liar = KEYS[0]
    a, b, c, d = KEYS[10:14]
    full = hb(KEYS[1:1 + MAX_HEARTBEAT_BANS])  # its 8 latest bans: an older one may be ours
    node = Node([liar], {a: hb(), b: hb([liar]), c: full, d: hb(state="leaving")})
    node._hand_over_bans(SimpleNamespace(allreduce_timeout_s=1.0))
    assert node.sent == [[(peer_id_from_public_key(a), liar)]]
