"""S3 general purpose bucket names: the rules a name given in the settings must follow.

From the Amazon S3 user guide, "General purpose bucket naming rules" (bucketnamingrules.html,
which botocore's CreateBucket documentation points to; its model carries no pattern): 3 to 63
characters; lowercase letters, numbers, periods and hyphens; a letter or number first and last;
no two adjacent periods; not formatted as an IP address; none of the reserved prefixes and
suffixes below.
"""

from __future__ import annotations

import re

_CHARACTERS = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IP_ADDRESS = re.compile(r"^\d{1,3}(?:\.\d{1,3}){3}$")
RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def bucket_name_problem(name: str) -> str | None:
    """What is wrong with `name` as an S3 general purpose bucket name, or None."""
    if not _CHARACTERS.match(name):
        return (
            "not 3-63 lowercase letters, digits, '.' and '-' starting and ending with a letter "
            "or digit"
        )
    if ".." in name:
        return "not allowed: it has two adjacent periods"
    if _IP_ADDRESS.match(name):
        return "formatted as an IP address"
    for prefix in RESERVED_PREFIXES:
        if name.startswith(prefix):
            return f"not allowed: {prefix} is a reserved prefix"
    for suffix in RESERVED_SUFFIXES:
        if name.endswith(suffix):
            return f"not allowed: {suffix} is a reserved suffix"
    return None
