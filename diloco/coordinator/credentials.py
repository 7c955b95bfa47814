"""Who calls the coordinator: the job token, and per-group credentials derived from it.

The coordinator holds the job token T. Everything else is derived from it::

    group credential of group g = "g<g>." + hex(HMAC-SHA256(T, "diloco/coordinator/group:<g>"))

Calls carry ``authorization: Bearer <credential>``. The job token is the operator's: it may call
every method (``RequestStop`` only with it). A group credential is a group's: it may ``Ping``,
read the plan, and make the calls *of its own group* (join, heartbeat, progress, round hashes,
summary, bandwidth, quorum, vote, state offers of which it is the donor, waiting for offers of
which it is the healer); a call for another group is refused with PERMISSION_DENIED. A rank that
holds the job token sends only its group's credential (`for_group`), so the job token never
leaves the process; to confine a group, give its ranks only ``group_token(T, g)`` as
``DILOCO_TOKEN``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import NamedTuple

_LABEL = "diloco/coordinator/group:"
_GROUP_TOKEN = re.compile(r"g(\d{1,9})\.([0-9a-f]{64})")
#: metadata key with the group a call acts for, sent by clients of a coordinator without a token
#: (unauthenticated: used only to share the call limits fairly among groups)
GROUP_HEADER = "diloco-group"

#: the request field naming the group a call acts for, per group-scoped method
GROUP_FIELDS: dict[str, str] = {
    "Join": "group", "Heartbeat": "group", "ReportProgress": "group", "ReportRound": "group",
    "ReportSummary": "group", "ReportBandwidth": "group", "Quorum": "group", "Commit": "group",
    "OfferState": "donor_group", "WaitOffer": "healer_group",
}
#: methods only the job token may call
ADMIN_ONLY = frozenset({"RequestStop"})


class Caller(NamedTuple):
    """Who made a call: ``admin`` (the job token, or anyone when the coordinator has no token),
    ``group`` (the group whose credential it showed, or claimed without a token; None: none),
    ``verified`` (the credential was checked)."""

    admin: bool
    group: int | None
    verified: bool

    @property
    def key(self) -> str:
        """What the call limits are counted by."""
        if self.group is not None:
            return f"group {self.group}"
        return "job token" if self.verified else "anonymous"


def group_token(job_token: str, group: int) -> str:
    """Group ``group``'s coordinator credential, derived from the job token."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ValueError(f"group must be an int >= 0, got {group!r}")
    mac = hmac.new(job_token.encode(), f"{_LABEL}{group}".encode(), hashlib.sha256).hexdigest()
    return f"g{group}.{mac}"


def parse_group_token(token: str) -> int | None:
    """The group a group credential names (not checked); None if ``token`` is not one."""
    m = _GROUP_TOKEN.fullmatch(token)
    return int(m.group(1)) if m else None


def for_group(token: str | None, group: int) -> str | None:
    """What a rank of ``group`` shows the coordinator: its group credential, derived from the job
    token (or ``token`` itself when it already is group ``group``'s credential); None without a
    token. ValueError for another group's credential."""
    if token is None:
        return None
    named = parse_group_token(token)
    if named is None:
        return group_token(token, group)
    if named != group:
        raise ValueError(f"the coordinator credential is group {named}'s, not group {group}'s")
    return token


def check(job_token: str, bearer: str) -> Caller | None:
    """The caller a bearer credential proves, or None if it proves nothing (constant time)."""
    if hmac.compare_digest(bearer.encode(), job_token.encode()):
        return Caller(admin=True, group=None, verified=True)
    group = parse_group_token(bearer)
    if group is not None and hmac.compare_digest(bearer.encode(), group_token(job_token, group).encode()):
        return Caller(admin=False, group=group, verified=True)
    return None
